"""Release artifacts (docs/release.md): hack/release.sh run for real.

The chart goes to a real OCI registry (the CNCF distribution registry, started here on a free
127.0.0.1 port with its storage in a temporary folder) with ``helm push`` and comes back with
``helm pull``, the same bytes and the same render; the kubectl plugin is installed by a real krew
from the manifest the script wrote, into a temporary KREW_ROOT, and runs the CLI. helm, the
registry and krew are built by ``hack/cluster/build.sh helm registry krew`` (hack/test.sh does it);
a missing one is a failure, not a skip. One version everywhere is a unit test.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tomllib
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from .helpers import CACHE, wait_until

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "agentfast"
HELM_CHART_LAYER = "application/vnd.cncf.helm.chart.content.v1.tar+gzip"


def _versions() -> dict[str, str]:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    released = re.findall(r"^## \[(\d[^\]]*)\]", (REPO / "CHANGELOG.md").read_text(), re.M)
    return {
        "Chart.yaml version": chart["version"],
        "Chart.yaml appVersion": chart["appVersion"],
        "pyproject.toml version": pyproject["project"]["version"],
        "CHANGELOG.md latest release": released[0],
    }


VERSION = _versions()["Chart.yaml version"]


def test_one_version_everywhere() -> None:
    versions = _versions()
    assert len(set(versions.values())) == 1, f"bump them together: {versions}"
    changelog = (REPO / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\](.*)$", changelog, re.M)
    # Keep a Changelog: Unreleased first, then each release with its date, newest first.
    assert headings[0] == ("Unreleased", "")
    assert all(re.fullmatch(r" - \d{4}-\d{2}-\d{2}", date) for _, date in headings[1:]), headings
    assert f"[{VERSION}]: " in changelog and "[Unreleased]: " in changelog  # the link references


def _binary(name: str, env: str) -> str:
    found = os.environ.get(env)
    if not found:
        cached = sorted(glob.glob(str(CACHE / "k8s-bin" / "*" / name)))
        found = cached[-1] if cached else None
    if not found:
        pytest.fail(f"{name} not found: run hack/cluster/build.sh helm registry krew (or set {env}=/path/to/{name})")
    return found


@pytest.fixture(scope="module")
def helm() -> str:
    return _binary("helm", "HELM")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real OCI registry (distribution's ``registry serve``) on 127.0.0.1, plain HTTP, its
    storage in a temporary folder; stopped at the end. Yields ``host:port``."""
    binary = _binary("registry", "REGISTRY_BIN")
    base = tmp_path_factory.mktemp("registry")
    port = _free_port()
    config = {
        "version": 0.1,
        "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(base / "storage")}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}"},
    }
    (base / "config.yml").write_text(yaml.safe_dump(config))
    log = (base / "registry.log").open("w")
    proc = subprocess.Popen([binary, "serve", str(base / "config.yml")], stdout=log, stderr=subprocess.STDOUT)

    def up() -> bool:
        assert proc.poll() is None, (base / "registry.log").read_text()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    try:
        wait_until(up, timeout=30, what="the registry to answer /v2/")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def released(helm: str, registry: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """hack/release.sh, once, into a folder of its own, pushing the chart to the test registry."""
    dist = tmp_path_factory.mktemp("dist")
    env = {
        **os.environ,
        "HELM": helm,
        "REGISTRY": f"oci://{registry}/charts",
        "RELEASE_PLAIN_HTTP": "1",
        "RELEASE_DIST": str(dist),
        "AGENTFAST_VENV": sys.prefix,  # this venv (hack/test.sh installs the release extra into it)
    }
    proc = subprocess.run(["bash", str(REPO / "hack" / "release.sh")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"dist": dist, "out": proc.stdout}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.process
def test_release_makes_every_artifact_with_its_sum(released: dict[str, object]) -> None:
    dist = released["dist"]
    assert isinstance(dist, Path)
    names = {
        f"agentfast-{VERSION}.tgz",
        f"agentfast-{VERSION}-py3-none-any.whl",
        f"agentfast-{VERSION}.tar.gz",
        f"kubectl-agentfast-{VERSION}.tar.gz",
        "agentfast.yaml",
    }
    assert {p.name for p in dist.iterdir()} == names | {"SHA256SUMS"}
    sums = dict(reversed(line.split("  ")) for line in (dist / "SHA256SUMS").read_text().splitlines())
    assert sums == {name: _sha256(dist / name) for name in names}
    for name, digest in sums.items():  # and the script says what it made
        assert f"{digest}  {name}" in str(released["out"])
    # The wheel: this version, both console scripts, the data files the package reads.
    with zipfile.ZipFile(dist / f"agentfast-{VERSION}-py3-none-any.whl") as whl:
        files = set(whl.namelist())
        meta = whl.read(f"agentfast-{VERSION}.dist-info/METADATA").decode()
        scripts = whl.read(f"agentfast-{VERSION}.dist-info/entry_points.txt").decode()
    assert f"\nVersion: {VERSION}\n" in meta
    assert "agentfast = agentfast.runner.cli:main" in scripts and "kubectl-agentfast = agentfast.runner.cli:main" in scripts
    assert {
        "agentfast/runner/scaffold/templates/Dockerfile.tmpl",
        "agentfast/runner/py.typed",
        "agentfast/runner/inbox_pages/index.html",  # `agentfast ui`'s pages and assets
        "agentfast/runner/inbox_pages/static/inbox.js",
        "agentfast/runner/inbox_pages/static/inbox.css",
    } <= files
    assert any(f.startswith("agentfast/testing/scripts/") and f.endswith(".yaml") for f in files)


@pytest.mark.process
def test_the_chart_goes_through_a_real_oci_registry_unchanged(
    released: dict[str, object], registry: str, helm: str, tmp_path: Path
) -> None:
    dist = released["dist"]
    assert isinstance(dist, Path)
    tarball = dist / f"agentfast-{VERSION}.tgz"
    pushed = re.search(r"Pushed: (\S+)\s+Digest: (sha256:[0-9a-f]{64})", str(released["out"]))
    assert pushed, released["out"]
    assert pushed.group(1) == f"{registry}/charts/agentfast:{VERSION}"
    # What the registry holds: an OCI manifest whose digest helm printed, with our tarball as its
    # chart layer, byte for byte.
    req = urllib.request.Request(
        f"http://{registry}/v2/charts/agentfast/manifests/{VERSION}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        manifest = json.loads(r.read())
        assert r.headers["Docker-Content-Digest"] == pushed.group(2)
    [layer] = [x for x in manifest["layers"] if x["mediaType"] == HELM_CHART_LAYER]
    assert layer["digest"] == f"sha256:{_sha256(tarball)}" and layer["size"] == tarball.stat().st_size
    # helm pull, as a user would: the same digest, the same bytes, the same render as the checkout's chart.
    pulled = subprocess.run(
        [helm, "pull", f"oci://{registry}/charts/agentfast", "--version", VERSION, "--plain-http", "-d", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"Digest: {pushed.group(2)}" in pulled.stdout + pulled.stderr
    assert _sha256(tmp_path / tarball.name) == _sha256(tarball)

    def render(chart: str, *extra: str) -> str:  # with a Secret of one's own: no generated password differs
        args = [helm, "template", "agentfast", chart, "--namespace", "agentfast", "--include-crds", *extra]
        args += ["--set", "postgresql.existingSecret=agentfast-postgres"]
        return subprocess.run(args, capture_output=True, text=True, check=True).stdout

    checkout = render(str(CHART))
    assert render(str(tmp_path / tarball.name)) == checkout
    assert render(f"oci://{registry}/charts/agentfast", "--version", VERSION, "--plain-http") == checkout
    assert f"image: agentfast:{VERSION}" in checkout  # the image released with the chart


@pytest.mark.process
def test_krew_installs_the_plugin_from_the_manifest_and_it_runs_the_cli(released: dict[str, object], tmp_path: Path) -> None:
    krew = _binary("krew", "KREW")
    dist = released["dist"]
    assert isinstance(dist, Path)
    archive = dist / f"kubectl-agentfast-{VERSION}.tar.gz"
    manifest = yaml.safe_load((dist / "agentfast.yaml").read_text())
    assert manifest["apiVersion"] == "krew.googlecontainertools.github.com/v1alpha2" and manifest["kind"] == "Plugin"
    [platform] = manifest["spec"]["platforms"]
    assert manifest["spec"]["version"] == f"v{VERSION}"
    assert platform["uri"].endswith(f"/v{VERSION}/kubectl-agentfast-{VERSION}.tar.gz") and platform["sha256"] == _sha256(archive)
    with tarfile.open(archive) as tar:
        member = tar.getmember("kubectl-agentfast")
        assert member.mode & 0o111 and f'VERSION="{VERSION}"' in tar.extractfile(member).read().decode()  # type: ignore[union-attr]

    root = tmp_path / "krew"
    system = "/usr/bin:/bin"
    env = {"HOME": str(tmp_path), "KREW_ROOT": str(root), "KREW_NO_UPGRADE_CHECK": "1", "PATH": system}

    def krew_run(*args: str, archive_path: Path = archive) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [krew, *args, f"--manifest={dist / 'agentfast.yaml'}", f"--archive={archive_path}"],
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )

    # krew checks the archive against the manifest's sha256: a changed archive is refused.
    tampered = tmp_path / archive.name
    tampered.write_bytes(archive.read_bytes() + b"\0")
    refused = krew_run("install", archive_path=tampered)
    assert refused.returncode != 0 and f"checksum does not match, want: {_sha256(archive)}" in refused.stderr, refused.stderr

    installed = krew_run("install")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "Installed plugin: agentfast" in installed.stdout + installed.stderr
    # krew's receipt of the install (`krew list` would need krew's index, a git clone from GitHub).
    receipt = yaml.safe_load((root / "receipts" / "agentfast.yaml").read_text())
    assert receipt["kind"] == "Plugin" and receipt["spec"]["version"] == f"v{VERSION}"
    assert (root / "store" / "agentfast" / f"v{VERSION}" / "kubectl-agentfast").is_file()
    plugin = root / "bin" / "kubectl-agentfast"

    def run_plugin(path: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(plugin), "--help"], env={**env, "PATH": path, **extra}, capture_output=True, text=True, timeout=60
        )

    # As kubectl finds it (KREW_ROOT/bin first on PATH), with pip's agentfast (this venv) on PATH:
    # the launcher hands over to pip's kubectl-agentfast, which knows it is the kubectl plugin.
    venv_bin = str(Path(sys.executable).parent)
    ran = run_plugin(f"{root / 'bin'}:{venv_bin}:{system}")
    assert ran.returncode == 0 and ran.stdout.startswith("Usage: kubectl-agentfast "), ran.stdout + ran.stderr
    # Without it on PATH, a named Python that has agentfast runs the CLI under the same name.
    ran = run_plugin(f"{root / 'bin'}:{system}", AGENTFAST_PYTHON=sys.executable)
    assert ran.returncode == 0 and ran.stdout.startswith("Usage: kubectl-agentfast "), ran.stdout + ran.stderr
    # Without agentfast at all: a clear message saying what to install, exit 127 (command not found).
    false = shutil.which("false", path=system)
    assert false
    ran = run_plugin(f"{root / 'bin'}:{system}", AGENTFAST_PYTHON=false)
    assert ran.returncode == 127 and f"pip install agentfast=={VERSION}" in ran.stderr, ran.stdout + ran.stderr
