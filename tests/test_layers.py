"""The packages' layering: imports point down only — app, training, bench → engine → model.

`model/` (the network) imports neither `engine` nor `app`; `engine/` (scheduling, no HTTP) never imports `app`.
Function-level (lazy) imports count too: the check walks every import statement of every file.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {"model": {"engine", "app", "training", "bench"}, "engine": {"app", "training", "bench"}}


def imported_packages(path: Path) -> set[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, a.name.split(".")[0]) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.lineno, node.module.split(".")[0]))
    return found


def violations(package: str, root: Path = REPO) -> list[str]:
    return [f"{path.relative_to(root)}:{line} imports {top}"
            for path in sorted((root / package).rglob("*.py"))
            for line, top in sorted(imported_packages(path)) if top in FORBIDDEN[package]]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down(package):
    assert violations(package) == []


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "x.py").write_text("def f():\n    from app.config import Settings\n")
    assert violations("model", tmp_path) == ["model/x.py:2 imports app"]
