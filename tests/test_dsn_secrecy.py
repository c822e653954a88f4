"""Issue 13 item 7: no message ever carries a password, whatever the DSN's shape.

A DSN libpq cannot parse used to reach psycopg.pool, whose WARNING lines quoted libpq's parse
error, and with it the password (``invalid percent-encoded token: "s3cret%zzPW"``, ``missing "="
after "s3cretPW"``). Now :func:`agentfast.runner.store.parse_dsn` refuses it before any pool or
connection exists, with a message that quotes none of it (exit 2), and every message that shows a
DSN goes through :func:`~agentfast.runner.store.redact_dsn`. Driven through the real CLI as a
subprocess; the secret token must appear nowhere in stdout and stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from agentfast.runner.store import InvalidDsn, Store, parse_dsn, redact_dsn

from .helpers import run_cli

SECRET = "s3cretPW"

# (id, DSN): each is malformed; SECRET is the password (or the text a password would be).
MALFORMED = [
    ("uri-ipv6-unclosed", f"postgresql://u:{SECRET}@[::1/db"),
    ("uri-bad-percent", "postgresql://u:s3cret%zzPW@host/db"),
    ("uri-bad-percent-end", f"postgresql://u:{SECRET}%@host/db"),
    ("uri-bad-percent-in-user", f"postgresql://{SECRET}%g1:x@host/db"),
    ("uri-space-in-password", "postgresql://u:s3cret PW@host/db"),
    ("uri-unicode-space-password", "postgresql://u:s3cret\u00e4 PW\u00df@host/db"),
    ("uri-unencoded-at-in-password", "postgresql://u:s3cret@PW@host/db"),
    ("uri-unencoded-slash-in-password", "postgresql://u:s3cret/PW@host/db"),
    ("uri-forgot-host", f"postgresql://u:{SECRET}/db"),
    ("uri-password-in-port", f"postgresql://[::1]:{SECRET}/db"),
    ("uri-two-ports", f"postgresql://u:{SECRET}@h:5432:5433/db"),
    ("uri-unknown-option", f"postgresql://u:x@h/db?passwrod={SECRET}"),
    ("uri-query-no-equals", f"postgresql://u:x@h/db?{SECRET}"),
    ("uri-port-option-password", f"postgresql://u:x@h/db?port={SECRET}"),
    ("uri-one-slash", f"postgresql:/u:{SECRET}@h/db"),
    ("uri-without-scheme", f"u:{SECRET}@h/db"),
    ("kv-bare-word", f"host=x {SECRET}"),
    ("kv-unquoted-space", "host=x password=s3cret PW"),
    ("kv-unterminated-quote", "host=x password='s3cretPW"),
    ("kv-unterminated-after-escape", "host=x password='s3cret\\' PW"),
    ("kv-quote-unicode", "host=x password='s3cret\u00e9\u201cPW user=u"),
    ("kv-unknown-option-next-to-password", f"host=x passwrod={SECRET}"),
    ("kv-unknown-option-then-password", f"host=x bogus=1 password={SECRET}"),
    ("kv-missing-value", f"host=x password= = {SECRET}"),
    ("kv-host-with-at", f"host=u@{SECRET} dbname=d"),
    ("kv-connect-timeout-password", f"host=x connect_timeout={SECRET}"),
    ("nul-byte", f"host=x password={SECRET}\x00"),
]


def _cli(args: list[str], env_dsn: str | None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("AGENTFAST_DSN", "AGENTFAST_FAULT")}
    if env_dsn is not None:
        env["AGENTFAST_DSN"] = env_dsn
    return subprocess.run(
        [sys.executable, "-m", "agentfast.runner", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _assert_refused(proc: subprocess.CompletedProcess) -> None:
    text = proc.stdout + proc.stderr
    for token in (SECRET, "s3cret", "PW@", "%zz"):
        assert token not in text, text
    assert proc.returncode == 2, text
    assert "DSN is not valid" in text and "libpq URI" in text and "key=value" in text, text
    assert "Traceback" not in text and "psycopg.pool" not in text, text


@pytest.mark.process
@pytest.mark.parametrize("dsn", [d for _, d in MALFORMED], ids=[i for i, _ in MALFORMED])
def test_a_malformed_dsn_is_refused_without_quoting_it(dsn: str) -> None:
    if "\x00" in dsn:  # an argv or an environment value cannot hold a NUL: the library refuses it
        with pytest.raises(InvalidDsn) as info:
            Store(dsn)
        assert SECRET not in str(info.value)
        return
    _assert_refused(_cli(["list", "--dsn", dsn], env_dsn=None))


@pytest.mark.process
@pytest.mark.parametrize("command", [["status", "some-run"], ["history", "some-run"], ["approve", "some-run", "call-1-0"]])
def test_every_command_refuses_it_from_the_environment_too(command: list[str]) -> None:
    _assert_refused(_cli(command, env_dsn="postgresql://u:s3cret%zzPW@host/db"))


@pytest.mark.process
def test_agentfast_run_refuses_it_before_registering_anything(tmp_path) -> None:
    from .helpers import agentrun_file

    _assert_refused(_cli(["run", str(agentrun_file(tmp_path))], env_dsn=f"host=x {SECRET}"))


@pytest.mark.process
@pytest.mark.parametrize("password", ["s3cret PW", "s3cret'PW", 's3cret"PW\\', "s3cret\u00e4\u00dfPW\u2603"])
def test_a_valid_dsn_that_cannot_connect_names_the_server_not_the_password(password: str) -> None:
    # key=value form with the password quoted as libpq wants it: parsed, then the connection fails
    quoted = "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"
    socket_dir = f"/nonexistent/agentfast-{uuid.uuid4().hex[:8]}"
    dsn = f"host={socket_dir} dbname=d user=u password={quoted}"
    assert parse_dsn(dsn)["password"] == password
    proc = run_cli("list", dsn=dsn, timeout=60)
    assert proc.returncode == 3, proc.stdout
    assert password not in proc.stdout and "s3cret" not in proc.stdout, proc.stdout
    assert "cannot connect to Postgres" in proc.stdout and socket_dir in proc.stdout and '"password": "***"' in proc.stdout


def test_parse_and_redact() -> None:
    uri = "postgresql://agentfast:p%40ss@db.example:5433,db2:5432/postgres?sslmode=require&sslpassword=k3y"
    info = parse_dsn(uri)
    assert info["password"] == "p@ss" and info["host"] == "db.example,db2" and info["port"] == "5433,5432"
    shown = redact_dsn(uri)
    assert "p@ss" not in shown and "k3y" not in shown and '"password": "***"' in shown and "db.example" in shown
    assert parse_dsn("") == {}
    for ok in (
        "host=/tmp/sock dbname=x",
        "host='/Users/a b/Library/Application Support/pg' dbname=x",
        "host=agentfast_db user=u",
        "host=@abstract dbname=x",
        "postgresql://u@[fe80::1%25eth0]:5432/x",
        "hostaddr=10.0.0.1 port=5432",
        "host=a,b port=,5433",
    ):
        parse_dsn(ok)
    for _, bad in MALFORMED:
        with pytest.raises(InvalidDsn) as info_:
            parse_dsn(bad)
        err = info_.value
        assert SECRET not in str(err) and "s3cret" not in str(err)
        assert err.__cause__ is None and err.__context__ is None  # no libpq message rides along
        assert redact_dsn(bad) == "(an invalid DSN, not shown)"


def test_operator_settings_never_show_the_dsn(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentfast.operator.main import Settings

    monkeypatch.setenv("AGENTFAST_DSN", f"postgresql://agentfast:{SECRET}@db/postgres")
    assert SECRET not in repr(Settings())
