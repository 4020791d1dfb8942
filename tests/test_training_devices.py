"""Training builds every tensor on the model's device (issue 31: the task loop stacked a CPU tensor with CUDA ones,
which fails the first fine-tuning step on a GPU). CPU-only tests cannot see that (every tensor is on the CPU, and
PyTorch lets no second device stand in for CUDA there: a "meta" tensor mixes with CPU scalars silently and runs no
real step), so this is a lint: each tensor constructor call in training/ names a device, or carries a
`# host tensor: <why>` comment; the loops use BaseLoop.on_device, which names it for them."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from training.loop import BaseLoop

REPO = Path(__file__).resolve().parents[1]
CONSTRUCTORS = {"tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "linspace", "eye", "rand",
                "randn", "randint"}
MARKER = "# host tensor:"
# whole modules that never touch a model's device
CPU_ONLY = {"bow_baseline.py": "the bag-of-words baseline: full-batch CPU regression, deterministic by design"}


def deviceless_constructors(path: Path) -> list[str]:
    name = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in CONSTRUCTORS):
            continue
        if any(k.arg == "device" for k in node.keywords) or any(k.arg is None for k in node.keywords):
            continue
        span = lines[node.lineno - 1:(node.end_lineno or node.lineno)]
        if not any(MARKER in line for line in span):
            found.append(f"{name}:{node.lineno}: torch.{node.func.attr}(...) without device=")
    return found


def test_every_tensor_built_in_training_names_its_device():
    files = sorted(p for p in (REPO / "training").glob("*.py") if p.name not in CPU_ONLY)
    assert len(files) > 10
    problems = [msg for p in files for msg in deviceless_constructors(p)]
    assert not problems, "build them with BaseLoop.on_device or pass device=:\n" + "\n".join(problems)


def test_the_lint_sees_a_deviceless_constructor(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text("import torch\n\nx = torch.tensor(1.0, dtype=torch.float64)\ny = torch.zeros(3, device=d)\n"
                 "z = torch.ones(2)  # host tensor: read back at once\n")
    assert deviceless_constructors(f) == ["probe.py:3: torch.tensor(...) without device="]


def test_on_device_puts_what_it_builds_on_the_loops_device():
    loop = BaseLoop.__new__(BaseLoop)
    loop.device = torch.device("meta")  # a second device: nothing is computed, the placement shows
    t = loop.on_device(torch.tensor, 3.0, dtype=torch.float64)
    assert t.device.type == "meta" and t.dtype == torch.float64
    assert loop.on_device(torch.zeros, 3).device.type == "meta"
