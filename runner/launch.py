"""What a run's spec may give a program the tool host starts (a stdio MCP server, docs/mcp.md):
its environment and its command line.

A spec names an allowed program; the variables and arguments it adds must not make that program
load or run anything no allow-list names (issue 30, item 3). Two layers:

- built in, everywhere (``agentfast run``, the operator, the runner, the tool host): the
  variables of :data:`ENV_DENIED`, whatever an admin allows (:func:`env_refusal`), and values
  with a control character or over :data:`MAX_ENV_VALUE` characters (:func:`env_value_refusal`);
- where an admin's policy applies (a cluster): a variable only if the admin lists its name
  (the chart's ``mcp.allowedEnv``), and a command only as an admin's entry spells it
  (the chart's ``mcp.allowedCommands``, :func:`command_refusal`): an interpreter only with the
  script the entry names, a launcher only exactly as written.

Pure functions of strings: nothing is imported, read or started here (G12).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: An environment variable name a spec may write (POSIX portable names).
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
#: Longest value of one variable, characters; at most 32 variables per server (spec.MAX_MCP_ENV).
MAX_ENV_VALUE = 1024
#: Longest variable name, characters.
MAX_ENV_NAME = 128

#: Variables no spec may set, even where an admin lists them (docs/mcp.md, "What env may never
#: set", says why for each): ``(names, why)``; a name ending with ``*`` is a prefix. Compared upper-cased, so
#: ``http_proxy`` is ``HTTP_PROXY``. Each makes a process load or run code, or read the start-up
#: files, trust anchors or routes, that the variable names instead of the image's own.
ENV_DENIED: tuple[tuple[tuple[str, ...], str], ...] = tuple(
    (tuple(names.split()), why)
    for names, why in (
        (
            "LD_* DYLD_* LIBPATH SHLIB_PATH GCONV_PATH GLIBC_TUNABLES MALLOC_*",
            "the dynamic loader and the C library load libraries (or tune themselves) from it",
        ),
        ("PATH", "it chooses which program a command name runs, the server's own command included"),
        (
            "BASH_* ENV SHELLOPTS BASHOPTS PS1 PS2 PS3 PS4 PROMPT_COMMAND IFS CDPATH GLOBIGNORE ZDOTDIR FPATH SHELL HISTFILE INPUTRC",
            "a shell runs code from it, or changes how it reads its commands",
        ),
        ("PYTHON* PIP_* UV_* PIPX_*", "Python and its package tools import, run or install code from it"),
        (
            "NODE_* NPM_CONFIG_* YARN_* COREPACK_* BUN_* DENO_*",
            "Node.js, Deno, Bun and their package managers load code or packages from it",
        ),
        ("PERL*", "Perl loads modules or runs code from it"),
        ("RUBY* GEM_* BUNDLE_*", "Ruby and its package tools load code from it"),
        (
            "JAVA_TOOL_OPTIONS _JAVA_OPTIONS JDK_JAVA_OPTIONS JAVA_HOME CLASSPATH",
            "the Java launcher adds agents, options or classes from it",
        ),
        ("DOTNET_* CORECLR_* COR_* COMPLUS_*", ".NET loads start-up hooks or profilers from it"),
        (
            "LUA_* PHPRC PHP_INI_SCAN_DIR R_PROFILE R_PROFILE_USER R_ENVIRON R_ENVIRON_USER R_LIBS R_LIBS_USER R_LIBS_SITE TCLLIBPATH GOFLAGS GOTOOLCHAIN GOPROXY GOPATH GOROOT GOENV",
            "an interpreter or build tool loads code or configuration from it",
        ),
        (
            "GIT_* EDITOR VISUAL PAGER MANPAGER LESSOPEN LESSCLOSE BROWSER SSH_* SUDO_ASKPASS",
            "a program runs the command it names",
        ),
        (
            "HOME XDG_*",
            "programs read their start-up files from there (shell rc files, .npmrc, .gitconfig, Python's user site-packages)",
        ),
        (
            "OPENSSL_* SSL_CERT_* SSLKEYLOGFILE REQUESTS_CA_BUNDLE CURL_CA_BUNDLE KRB5*",
            "TLS and Kerberos libraries load modules or configuration, trust certificates or write session keys from it",
        ),
        (
            "HTTP_PROXY HTTPS_PROXY ALL_PROXY NO_PROXY FTP_PROXY HOSTALIASES RES_OPTIONS LOCALDOMAIN",
            "it sends the server's connections, and the credentials they carry, where the run's author chooses",
        ),
        (
            "LOCPATH NLSPATH TERMINFO TERMINFO_DIRS TZDIR",
            "the C library parses locale, message or terminal data from the path it names",
        ),
        ("AGENTFAST_*", "agentfast's own settings are the admin's"),
    )
)


def env_refusal(name: str) -> str | None:
    """Why no spec may set the variable ``name`` (a sentence), or None. Built in, checked
    everywhere a spec is read and whatever an admin allows: :data:`ENV_DENIED`, and a name that
    is not a POSIX name or is over :data:`MAX_ENV_NAME` characters."""
    if len(name) > MAX_ENV_NAME or not re.match(ENV_NAME_PATTERN, name):
        return f"not a variable name (letters, digits and _, not starting with a digit; at most {MAX_ENV_NAME} characters)"
    upper = name.upper()
    for names, why in ENV_DENIED:
        for denied in names:
            if upper.startswith(denied[:-1]) if denied.endswith("*") else upper == denied:
                return f"no run may set it ({denied}: {why})"
    return None


def env_value_refusal(value: str) -> str | None:
    """Why ``value`` may not be a variable's value (a sentence), or None: over
    :data:`MAX_ENV_VALUE` characters, a control character (NUL ends a C string early, a newline
    starts a new line of an env file), or a lone surrogate (not UTF-8: it cannot be passed on)."""
    if len(value) > MAX_ENV_VALUE:
        return f"its value is over {MAX_ENV_VALUE} characters"
    bad = next((c for c in value if (ord(c) < 32 and c != "\t") or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF), None)
    if bad is not None:
        return f"its value holds the character U+{ord(bad):04X} (control characters and lone surrogates are refused)"
    return None


def arg_refusal(arg: str) -> str | None:
    """Why ``arg`` may not be an argument of a command (a sentence), or None: empty, over
    :data:`MAX_ENV_VALUE` characters, or holding NUL or a lone surrogate (neither can reach a
    program: the start would fail)."""
    if not arg or len(arg) > MAX_ENV_VALUE:
        return f"arguments are non-empty strings of at most {MAX_ENV_VALUE} characters"
    if "\0" in arg or any(0xD800 <= ord(c) <= 0xDFFF for c in arg):
        return "an argument holds NUL or a lone surrogate"
    return None


#: Programs that run the script their first operand names (``python S``, ``node S``, ``bash S``):
#: the words after the script are the script's, the words before it the interpreter's, so an
#: allowed entry must name the script (basename, any version suffix: ``python3.11``).
INTERPRETERS = re.compile(
    r"(?i)^(python|pypy|node|nodejs|bash|sh|dash|zsh|ksh|mksh|ash|yash|fish|csh|tcsh|perl|ruby|php|lua|luajit"
    r"|rscript|tclsh|wish|pwsh|julia|elixir|escript|guile|racket|osascript)[0-9.]*(\.exe)?$"
)
#: Programs that run another program, a package, or code written in their arguments (``env``,
#: ``npx``, ``busybox``, ``awk``, ``java``...): allowed only exactly as an entry spells them.
LAUNCHERS = re.compile(
    r"(?i)^(env|busybox|toybox|sudo|doas|su|runuser|setpriv|nice|nohup|timeout|stdbuf|setsid|chroot|unshare|nsenter"
    r"|ionice|taskset|chrt|flock|time|watch|xargs|parallel|strace|ltrace|gdb|valgrind|script|expect|tini|dumb-init"
    r"|catatonit|firejail|bwrap|npx|npm|pnpm|pnpx|yarn|corepack|bun|bunx|deno|uv|uvx|pipx|pip|poetry|pdm|hatch"
    r"|conda|mamba|micromamba|awk|gawk|mawk|nawk|sed|find|make|java|jshell|dotnet|go|cargo|docker|podman|kubectl"
    r"|ssh|socat|ncat|nc)[0-9.]*(\.exe)?$"
)


def _program(argv0: str) -> str:
    return argv0.rstrip("/").rsplit("/", 1)[-1]


def entry_refusal(entry: str) -> str | None:
    """Why an admin's ``mcp.allowedCommands`` entry (words separated by spaces) allows nothing
    (a sentence), or None. An interpreter's entry must end with its script or module
    (``python /app/server.py``, ``python -m orders_mcp``): a run's words come after the
    entry's, and an interpreter reads words before its script as its own options (``-c CODE``)."""
    words = entry.split()
    if not words:
        return "an empty entry"
    if INTERPRETERS.match(_program(words[0])) and (len(words) < 2 or words[-1].startswith("-")):
        return (
            f"{words[0]!r} is an interpreter: an entry names it with its script or module last"
            f" ({words[0]} /app/server.py, {words[0]} -m module), or it would run any code a run passes it"
        )
    return None


def command_refusal(argv: list[str], entries: Iterable[str]) -> str | None:
    """Why the command line ``argv`` is not allowed by the admin's ``entries`` (the chart's
    ``mcp.allowedCommands``, each a program or a program with its leading arguments, compared
    word by word as written: never resolved on a PATH), or None when one entry allows it.

    An entry allows a command that starts with its words; the command may add arguments after
    them, except for a launcher (:data:`LAUNCHERS`: the command must be exactly the entry). An
    interpreter's entry must name its script (:func:`entry_refusal`). Returns a sentence naming
    the entries."""
    entries = list(entries)
    near = None
    for entry in entries:
        words = entry.split()
        if not words or argv[: len(words)] != words:
            continue
        why = entry_refusal(entry)
        if why is None and LAUNCHERS.match(_program(words[0])) and len(argv) != len(words):
            why = f"{words[0]!r} runs what its arguments name: a run may use it only exactly as the entry {entry!r} spells it"
        if why is None:
            return None
        near = near or why
    listed = ", ".join(repr(e) for e in entries) or "none"
    if near is not None:
        return f"{near} (mcp.allowedCommands: {listed})"
    return f"{' '.join(argv)[:128]!r} is not a command this cluster allows for MCP servers (mcp.allowedCommands: {listed})"
