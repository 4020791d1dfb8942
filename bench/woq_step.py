"""Fewer weight bytes inside the compiled decode step: int8 weights through inductor's weight-only GEMM (its C++
micro-kernel over bf16 activations and int8 weights, `torch._weight_int8pack_mm` lowered with max_autotune) against
the fp32 step the engine compiles today, one row, in-process, at one thread, interleaved; optionally beside a process
that allocates Python objects on another CPU (as the HTTP front does: bench/neighbour.py).

    taskset -c 0 python -m bench.woq_step --model shakespeare --neighbour-cpu 1
    taskset -c 0 python -m bench.woq_step --model gpt2

A measurement before a build (issue 38's "fewer weight bytes" lead), not a served format: the eager int8 path is
fbgemm's W8A8 (model/linear.py `Int8Linear`), whose numbers differ from these (bf16 activations), so a compiled
int8 step needs its own reference before it can serve. Variants: `fp32` (the engine's package), `woq8` (int8 per
output row, bf16 activations and scales, the head too). Reports µs per step and the logits' largest difference.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.common import REPO, env_info, random_gpt2, write_result
from engine.compiled_decode import MANIFEST, WEIGHTS, Step, build_package, load_steps
from model.checkpoint import load_checkpoint
from model.kv_cache import KVCache
from model.linear import _act, _Served

ALLOC = "while True:\n    x = [str(i) for i in range(200000)]"


class WoqInt8Linear(_Served):
    """int8 per output row; y = _weight_int8pack_mm(x in bf16, q, scale in bf16) in fp32, + bias."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        w = lin.weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        self.register_buffer("q", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.bias = None if lin.bias is None else lin.bias.detach()

    def forward(self, x: torch.Tensor, act: nn.Module | None = None) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.q, self.scale)
        y = y.float().reshape(*x.shape[:-1], self.out_features)
        return _act(y if self.bias is None else y + self.bias, act)


def variant(model: nn.Module, name: str) -> nn.Module:
    twin = copy.deepcopy(model)
    if name == "woq8":
        for _, m in list(twin.named_modules()):
            for child, c in list(m.named_children()):
                if type(c) is nn.Linear:
                    setattr(m, child, WoqInt8Linear(c))
    return twin


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="shakespeare", choices=["shakespeare", "gpt2"])
    p.add_argument("--context", type=int, default=256, help="the step's context bucket (and the cache's length)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--neighbour-cpu", type=int, default=None, help="also time beside an allocating process there")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ckpt = REPO / "checkpoints" / "shakespeare" if args.model == "shakespeare" else random_gpt2()[1]
    model = load_checkpoint(ckpt).model.eval()
    cache = KVCache(model.config, 1, args.context)
    example = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.ones(1),
               torch.zeros(1, dtype=torch.long), torch.zeros(1), *(torch.zeros(1, dtype=torch.long) for _ in range(3)),
               *(torch.zeros_like(t) for t in cache.k), *(torch.zeros_like(t) for t in cache.v))
    steps, compile_s = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / WEIGHTS).mkdir()
        manifest = {}
        for name in ("fp32", "woq8"):
            t0 = time.perf_counter()
            manifest[f"{name}.so"] = build_package(Step(variant(model, name), args.context, args.context, None, 0, 0),
                                                   example, Path(tmp) / f"{name}.so", Path(tmp) / WEIGHTS)
            compile_s[name] = round(time.perf_counter() - t0, 1)
        (Path(tmp) / MANIFEST).write_text(json.dumps(manifest))
        loaded = load_steps(Path(tmp), list(manifest))  # mapped: Linux keeps them when the folder goes
        steps = {name: loaded[f"{name}.so"] for name in ("fp32", "woq8")}
    torch.manual_seed(0)  # a mid-context state: random keys and values, position 100
    inputs = list(example)
    inputs[0], inputs[1] = torch.tensor([[5]]), torch.tensor([min(100, args.context - 1)])
    for t in inputs[8:]:
        t.normal_()
    logits = {name: fn(*inputs) for name, fn in steps.items()}
    diff = (logits["woq8"] - logits["fp32"]).abs().max().item()
    same_argmax = bool((logits["woq8"].argmax(-1) == logits["fp32"].argmax(-1)).all())
    calls = 1000 if args.model == "shakespeare" else 100
    result = {"env": env_info(), "args": vars(args), "compile_s": compile_s, "max_abs_logit_diff": round(diff, 5),
              "same_argmax": same_argmax, "us_per_step": {}}
    for place in ["alone"] + (["beside-alloc"] if args.neighbour_cpu is not None else []):
        nb = None
        if place != "alone":
            nb = subprocess.Popen(["taskset", "-c", str(args.neighbour_cpu), sys.executable, "-c", ALLOC])
            time.sleep(1)
        times: dict[str, list[float]] = {name: [] for name in steps}
        try:
            with torch.inference_mode():
                for _ in range(args.rounds):
                    for name, fn in steps.items():
                        for _ in range(calls // 10):
                            fn(*inputs)
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            fn(*inputs)
                        times[name].append(round((time.perf_counter() - t0) / calls * 1e6, 1))
        finally:
            if nb is not None:
                nb.kill()
                nb.wait()
        med = {name: statistics.median(v) for name, v in times.items()}
        result["us_per_step"][place] = {"runs": times, "median": med,
                                        "woq8_over_fp32": round(med["woq8"] / med["fp32"], 3)}
        print(f"{args.model} {place}: fp32 {med['fp32']:.0f} us, woq8 {med['woq8']:.0f} us "
              f"({med['woq8'] / med['fp32']:.2f}x); max |dlogit| {diff:.4f}, same argmax {same_argmax}", flush=True)
    write_result(args.out or f"woq-step-{args.model}", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
