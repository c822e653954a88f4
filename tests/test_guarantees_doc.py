"""docs/architecture.md's table of guarantees stays true: every guarantee of DESIGN.md has a row,
and every module and test a row names exists (a renamed or deleted test fails here, not silently).

    pytest tests/test_guarantees_doc.py -q
"""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"
GUARANTEES = [f"G{i}" for i in range(1, 14)]  # DESIGN.md, "Guarantees" (G14: issue 30 item 4, not yet kept)


def _rows() -> dict[str, tuple[str, str]]:
    """{"G1": (kept-by cell, proved-by cell)} from the table under the guarantees heading."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## The guarantees", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"G\d+", cells[0]):
            rows[cells[0]] = (cells[2], cells[3])
    return rows


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_guarantee_has_a_row_with_a_module_and_a_test():
    rows = _rows()
    assert sorted(rows, key=lambda g: int(g[1:])) == GUARANTEES
    for g, (kept, proved) in rows.items():
        assert re.search(r"`(runner|operator)/[\w/]+\.py`", kept), f"{g}: no module keeps it"
        assert "::test_" in proved, f"{g}: no test proves it"


def test_every_named_module_and_test_exists():
    missing = []
    for g, (kept, proved) in _rows().items():
        for module in re.findall(r"`((?:runner|operator)/[\w/]+\.py)`", kept):
            if not (REPO / module).is_file():
                missing.append(f"{g}: {module}")
        for file, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", proved):
            path = REPO / file
            if not path.is_file() or name not in _test_functions(path):
                missing.append(f"{g}: {file}::{name}")
    assert not missing, "docs/architecture.md names what does not exist: " + "; ".join(missing)
