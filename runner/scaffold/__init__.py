"""``agentfast init``: a new folder holding a team's own tools, ready to run, test and ship.

What it writes (the templates are the files of ``templates/``, one per file written; ``{{package}}``
and the other placeholders of :func:`render` are replaced, nothing else is interpreted):

- ``pyproject.toml``: the team's package, depending on ``agentfast``; ``pytest`` finds the package
  without an install.
- ``PACKAGE/__init__.py``, ``PACKAGE/tools.py``: two tools written with the public API
  (``from agentfast.runner import tool, ToolContext, Recovery``): ``apply_credit``, gated
  (``requires_approval=True``), and ``send_notice``, not idempotent (``idempotent=False``) with a
  recovery check. Both record their effects once per ``ctx.idempotency_key`` in JSON-lines files.
- ``agentrun.yaml``: an AgentRun naming them (``PACKAGE.tools:NAME``), on the scripted model
  playing ``script.yaml``, with a real model's ``spec.model.config`` and the cluster's
  ``spec.runner.image`` as commented alternatives.
- ``script.yaml``: the scripted model's conversation: a parallel batch calling both tools, then an
  answer.
- ``Dockerfile``: an image ``FROM`` agentfast's (``ARG AGENTFAST_IMAGE``) with the package added to
  its Python on a ``.pth`` path: it builds offline (nothing is downloaded or built).
- ``tests/test_tools.py``: a run for real (the ``agentfast`` CLI, the scripted model, Postgres), paused
  for the gated call, approved, resumed to ``Succeeded``; each effect counted once; and a runner
  killed right after the notice went out, whose resume asks the recovery check instead of sending
  it again.
- ``.dockerignore``: the build context without caches and tests.
- ``README.md``: how to run, test, build, allow and apply it.

The CLI command (``runner/cli.py``, ``init``) imports this module only when it runs.
"""

from __future__ import annotations

import keyword
import re
import sys
from importlib import resources
from pathlib import Path

from ..errors import AgentfastError

#: Each template of ``templates/`` and where it is written, relative to the new folder
#: (``{package}``: the package's name).
FILES: tuple[tuple[str, str], ...] = (
    ("pyproject.toml.tmpl", "pyproject.toml"),
    ("package_init.py.tmpl", "{package}/__init__.py"),
    ("tools.py.tmpl", "{package}/tools.py"),
    ("agentrun.yaml.tmpl", "agentrun.yaml"),
    ("script.yaml.tmpl", "script.yaml"),
    ("Dockerfile.tmpl", "Dockerfile"),
    ("dockerignore.tmpl", ".dockerignore"),
    ("test_tools.py.tmpl", "tests/test_tools.py"),
    ("README.md.tmpl", "README.md"),
)

#: A package name: an ASCII Python identifier (what ``spec.tools[i].ref`` accepts as a module).
PACKAGE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

#: Names a team's package cannot take: importing it would find agentfast's, or its test support's.
RESERVED = frozenset({"agentfast", "tests", "test"})

_PLACEHOLDER = re.compile(r"\{\{[a-z_]+\}\}")


class ScaffoldError(AgentfastError, ValueError):
    """``agentfast init`` cannot write what was asked: the package name is not one, or the folder
    is not new. ``str(err)`` says which and what to do; the CLI exits 2."""


def default_package(directory: str | Path) -> str:
    """The package name ``agentfast init DIR`` uses without ``--name``: DIR's last component,
    lower-cased, with ``-``, ``.`` and spaces made ``_`` (``team-a.tools`` -> ``team_a_tools``).
    Not checked: :func:`check_package` does that."""
    name = Path(directory).expanduser().absolute().name
    return re.sub(r"[-. ]", "_", name).lower()


def check_package(package: str) -> str:
    """Return ``package`` if it can be the team's package: an ASCII Python identifier, not a
    keyword, not a module of the standard library, not ``agentfast`` (nor ``test``/``tests``,
    the tests' folder). Raises ScaffoldError saying what to pass to ``--name`` instead."""
    if not re.match(PACKAGE_PATTERN, package):
        raise ScaffoldError(
            f"package name {package!r} is not a Python identifier (letters, digits and _, not starting with a digit);"
            " pass one with --name, e.g. --name team_tools"
        )
    if keyword.iskeyword(package) or keyword.issoftkeyword(package):
        raise ScaffoldError(f"package name {package!r} is a Python keyword; pass another with --name")
    if package in sys.stdlib_module_names or package in RESERVED:
        raise ScaffoldError(
            f"package name {package!r} is taken (the standard library's or agentfast's): importing it would find that"
            " module instead of yours; pass another with --name"
        )
    return package


def resource_name(package: str) -> str:
    """A Kubernetes name (DNS-1123 label) for ``package``: lower case, ``_`` made ``-``, at most
    63 characters (``Team_Tools`` -> ``team-tools``); ``tools`` if nothing is left."""
    name = re.sub(r"-+", "-", package.lower().replace("_", "-")).strip("-")[:63].rstrip("-")
    return name or "tools"


def render(package: str) -> dict[str, str]:
    """The files of a new folder for ``package`` (checked by :func:`check_package`): relative
    path (``/``-separated) -> text, in :data:`FILES`' order. Placeholders replaced:
    ``{{package}}``, ``{{name}}`` (:func:`resource_name`: the AgentRun's and image's name),
    ``{{dist}}`` (the distribution's name), ``{{records_env}}`` (the variable naming the tools'
    records folder). Raises ScaffoldError for a bad name; RuntimeError if a template is left
    with an unknown placeholder (a bug of this module, which tests/test_init.py would catch)."""
    check_package(package)
    values = {
        "{{package}}": package,
        "{{name}}": resource_name(package),
        "{{dist}}": package.replace("_", "-"),
        "{{records_env}}": f"{package.upper()}_RECORDS_DIR",
    }
    templates = resources.files(__name__).joinpath("templates")
    files = {}
    for template, target in FILES:
        text = templates.joinpath(template).read_text(encoding="utf-8")
        for placeholder, value in values.items():
            text = text.replace(placeholder, value)
        left = _PLACEHOLDER.findall(text)
        if left:
            raise RuntimeError(f"template {template}: unknown placeholders {sorted(set(left))}")
        files[target.format(package=package)] = text
    return files


def write(directory: str | Path, package: str) -> list[Path]:
    """Write :func:`render`'s files into ``directory`` (made, with its parents, if missing; an
    empty one is used). Returns the paths written, in order. Raises ScaffoldError, writing
    nothing, when ``directory`` exists and is not an empty folder, or ``package`` is no name."""
    root = Path(directory).expanduser()
    files = render(package)
    if root.exists() and not root.is_dir():
        raise ScaffoldError(f"{root} exists and is not a folder; name a new folder")
    if root.is_dir() and any(root.iterdir()):
        raise ScaffoldError(f"{root} exists and is not empty; name a new folder (nothing was written)")
    written = []
    for relative, text in files.items():
        path = root.joinpath(*relative.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
