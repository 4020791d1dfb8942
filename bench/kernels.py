"""The CPU matmul kernels behind each weight format (model/linear.py), timed on this machine.

    python -m bench.kernels [--rows 1,2,4,16,64] [--threads 2] [--out kernels]

GPT-2 124M's 48 block matmuls (c_attn, attn c_proj, c_fc, mlp c_proj × 12), cycling through distinct weights as a
decode step does (so no weight is hot in cache), at each row count: the median of 7 interleaved rounds of 3 passes,
in ms per pass. The variants are the candidates model/linear.py chooses between: fp32 through MKL (plain and
column-major weight) and oneDNN's packed copy, bf16 through oneDNN, int8 weight-only (PyTorch's
`_weight_int8pack_mm`), int8 through fbgemm with per-row-normalised activations (`Int8Linear`), int4 through
`Int4Linear` in groups of 32 and 128 (model/int4_kernel.py) and, in groups of 32, aten's
`_weight_int4pack_mm_for_cpu` that it replaced. Each variant's relative error against fp32 is reported too.
Results: bench/results/<out>.json with the CPU's flags (the choice is per CPU: AVX-512, avx512_bf16, AMX, VNNI).
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any
from unittest import mock

from bench.common import env_info, set_threads, write_result


def variants(C: int = 768):
    import torch
    import torch.nn.functional as F

    import model.linear as L
    from model import int4_kernel
    from model.cpu_support import support

    torch.manual_seed(0)
    shapes = [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)] * 12
    lins = []
    for o, i in shapes:
        lin = torch.nn.Linear(i, o)
        torch.nn.init.normal_(lin.weight, std=0.02)
        lins.append(lin.requires_grad_(False))
    v: dict[str, tuple[list, Any]] = {}
    v["fp32 MKL plain"] = ([lambda x, w=lin.weight, b=lin.bias: F.linear(x, w, b) for lin in lins], torch.float32)
    cm = [lin.weight.t().contiguous().t() for lin in lins]
    v["fp32 MKL column-major"] = ([lambda x, w=w, b=lin.bias: F.linear(x, w, b) for w, lin in zip(cm, lins)],
                                  torch.float32)
    if L.ONEDNN_LINEAR is not None and support().packed_fp32:
        v["fp32 oneDNN packed"] = ([L.PackedLinear(lin) for lin in lins], torch.float32)
    if L.ONEDNN_LINEAR is not None and support().packed_bf16:
        v["bf16 oneDNN packed"] = ([L.PackedLinear(copy.deepcopy(lin).to(torch.bfloat16)) for lin in lins],
                                   torch.bfloat16)
    else:  # what a bf16 server runs where oneDNN cannot pack bf16 (AVX2): the plain weight through F.linear
        b16 = [copy.deepcopy(lin).to(torch.bfloat16) for lin in lins]
        v["bf16 F.linear (no packing here)"] = ([lambda x, m=m: F.linear(x, m.weight, m.bias) for m in b16],
                                                torch.bfloat16)
    q8 = [L.quantize_int8(lin.weight) for lin in lins]
    v["int8 weight-only (bf16 x)"] = ([lambda x, q=q, b=lin.bias: torch.ops.aten._weight_int8pack_mm(
        x, q[0], q[1].bfloat16()) + b.bfloat16() for q, lin in zip(q8, lins)], torch.bfloat16)
    if support().fbgemm:
        v["int8 fbgemm row-normalised (Int8Linear)"] = (
            [L.Int8Linear(q[0], q[1], lin.bias, torch.float32) for q, lin in zip(q8, lins)], torch.float32)
    for g in (32, 128):
        v[f"int4 g{g} (Int4Linear)"] = (
            [L.Int4Linear(*L.quantize_int4(lin.weight, g), lin.bias, torch.float32, g) for lin in lins], torch.float32)
    if v["int4 g32 (Int4Linear)"][0][0].kernel:  # what Int4Linear ran before model/int4_kernel.py: aten's bf16 kernel
        with mock.patch.object(int4_kernel, "available", lambda: False):
            v["int4 g32 (aten's bf16 kernel)"] = (
                [L.Int4Linear(*L.quantize_int4(lin.weight, 32), lin.bias, torch.float32, 32) for lin in lins],
                torch.float32)
    return shapes, lins, v


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.nn.functional as F

    from model.cpu_support import support

    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,16,64")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every CPU)")
    p.add_argument("--out", default="kernels")
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    shapes, lins, v = variants()
    C = shapes[0][1]
    errors = {}
    with torch.inference_mode():
        for name, (fs, dt) in v.items():
            errs = []
            for j in range(4):
                x = torch.randn(4, shapes[j][1])
                ref = F.linear(x, lins[j].weight, lins[j].bias)
                errs.append(((fs[j](x.to(dt)).float() - ref).norm() / ref.norm()).item())
            errors[name] = round(max(errs), 5)
        table: dict[str, dict[str, float]] = {name: {} for name in v}
        for r in rows:
            xs = {dt: (torch.randn(r, C).to(dt), torch.randn(r, 4 * C).to(dt))
                  for dt in (torch.float32, torch.bfloat16)}
            samples: dict[str, list[float]] = {name: [] for name in v}
            for _ in range(7):
                for name, (fs, dt) in v.items():
                    a, b = xs[dt]
                    for j in range(4):
                        fs[j](a if shapes[j][1] == C else b)
                    t0 = time.perf_counter()
                    for _ in range(3):
                        for j in range(48):
                            fs[j](a if shapes[j][1] == C else b)
                    samples[name].append((time.perf_counter() - t0) / 3 * 1000)
            for name, s in samples.items():
                table[name][str(r)] = round(sorted(s)[len(s) // 2], 2)
            print(f"rows={r}: " + "  ".join(f"{n}={table[n][str(r)]}" for n in v), flush=True)
    data = {"env": env_info(), "threads": threads, "unit": "ms per pass over GPT-2 124M's 48 block matmuls",
            "cpu": support().describe(),
            "relative_error_vs_fp32": errors, "ms": table}
    print(f"wrote {write_result(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
