"""pyproject.toml's console commands (gpt-serve, gpt-train, ...): each names a callable main() of a module whose
`python -m` form answers --help, so the installed command and the documented `python -m` one are the same code."""

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_the_commands_are_declared():
    assert {"gpt-serve", "gpt-train", "gpt-finetune", "gpt-sample"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_command_is_its_modules_main(name):
    module, _, func = SCRIPTS[name].partition(":")
    assert func == "main", f"{name}: {SCRIPTS[name]} (the `python -m {module}` form calls main)"
    mod = importlib.import_module(module)
    assert callable(mod.main)
    assert 'if __name__ == "__main__":\n    sys.exit(main())' in Path(mod.__file__).read_text(), module
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: "), proc.stdout[:200]
