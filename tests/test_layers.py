"""The packages' layering: imports point down only — app, training, bench → engine → model — and no two modules
import each other, directly or in a circle.

`model/` (the network) imports neither `engine` nor `app`; `engine/` (scheduling, no HTTP) never imports `app`.
Within `training/`, the trainers' folders (`lm/`, `task/`, `chat/`) never import each other: what two of them share
lives at `training/`'s top level.
Function-level (lazy) imports count too: the checks walk every import statement of every file (a circle hidden
behind a function-level import is still a circle: two modules that are one job, or a job in the wrong room).
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


PACKAGES = ("model", "engine", "app", "training", "bench")


def module_graph(root: Path = REPO) -> dict[str, set[str]]:
    """module → the project modules it imports (a package's own submodules not counted for its __init__)."""
    mods = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py") if (root / pkg).is_dir() else ():
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            mods[name] = path
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    deps |= {sub} if sub in mods else {node.module} & set(mods)
        graph[name] = {d for d in deps if d != name and not d.startswith(name + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert circles(module_graph()) == []


def test_the_circle_check_sees_one_behind_a_function_level_import(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a.py").write_text("from model.b import x\n")
    (tmp_path / "model" / "b.py").write_text("def f():\n    from model import a\n")
    (tmp_path / "model" / "c.py").write_text("import model.a\n")
    assert circles(module_graph(tmp_path)) == [["model.a", "model.b"]]


TRAINERS = ("training.lm", "training.task", "training.chat")


def trainer_crossings(graph: dict[str, set[str]]) -> list[str]:
    """Imports from one trainer's folder into another's: what two trainers share belongs at training/ top level."""
    def trainer(module: str) -> str | None:
        return next((t for t in TRAINERS if module == t or module.startswith(t + ".")), None)
    return [f"{m} imports {d}" for m in sorted(graph) for d in sorted(graph[m])
            if trainer(m) and trainer(d) and trainer(m) != trainer(d)]


def test_trainers_share_only_through_the_top_level():
    assert trainer_crossings(module_graph()) == []


def test_the_trainer_check_sees_a_crossing():
    graph = {"training.chat.loop": {"training.task.data", "training.loop"}, "training.task.data": set()}
    assert trainer_crossings(graph) == ["training.chat.loop imports training.task.data"]
