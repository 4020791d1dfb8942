"""`make gpu-check`: the GPU path in one command, for a user verifying a deployment on a CUDA machine.

    python -m bench.gpu_check [--new-tokens 128] [--batches 1,16,64] [--out gpu-check]

1. the CUDA tests (`pytest -m "not slow" -k "cuda or graph" tests/`: graph replays equal eager decoding, ...);
2. the engine core on the GPU (bf16), the random GPT-2 124M of bench.common, CUDA graphs on and off, side by side:
   decode tok/s at each batch (every request greedy, `max_new_tokens` each, EOS ignored), time to first token
   of one request, and whether greedy tokens agree between graphs on and off;
3. one JSON report: bench/results/<out>.json.

Without CUDA it fails at once with one line (exit 1): this is the check a GPU machine must pass.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench.common import REPO, env_info, random_gpt2, write_result


def engine_run(ck_dir, batch: int, new_tokens: int, graphs: bool) -> dict:
    import torch

    from engine.core import EngineCore
    from engine.request import EngineRequest
    from engine.sampling import SamplingParams
    from model.checkpoint import load_checkpoint

    ck = load_checkpoint(ck_dir, device="cuda", dtype=torch.bfloat16)
    core = EngineCore(ck.model, n_slots=max(batch, 1), vocab_size=ck.tokenizer.vocab_size, eos_id=None,
                      cuda_graphs=graphs)
    core.warmup()
    prompt = ck.tokenizer.encode("The service had been running for three days when the first request arrived")
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    tokens: dict[str, list[int]] = {}
    for r in range(2):  # the first round warms the allocator and the graph buckets up
        for i in range(batch):
            core.add(EngineRequest(f"{r}-{i}", prompt, params, seed=i))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = None
        n = 0
        while core.has_work():
            outs = core.step()
            n += sum(len(o.token_ids) for o in outs)
            if first is None and outs:
                first = time.perf_counter() - t0
            for o in outs:
                tokens.setdefault(o.request_id, []).extend(o.token_ids)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return {"batch": batch, "cuda_graphs": graphs, "graphs_in_use": core.stats()["cuda_graphs"],
            "tok_s": round(n / wall, 1), "ttft_ms": round(1000 * first, 2), "wall_s": round(wall, 3),
            "tokens_first_request": tokens.get("1-0", [])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--out", default="gpu-check")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: gpu-check needs a CUDA device and a CUDA build of torch (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 1
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-k", "cuda or graph", "tests/"],
                           cwd=REPO, capture_output=True, text=True)
    print(tests.stdout[-2000:])
    _, ck_dir = random_gpt2()
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        for graphs in (True, False):
            row = engine_run(ck_dir, b, args.new_tokens, graphs)
            rows.append(row)
            print(f"batch {b:3d} cuda_graphs={graphs!s:5s} (in use: {row['graphs_in_use']}): {row['tok_s']:9.1f} tok/s "
                  f"TTFT {row['ttft_ms']} ms", flush=True)
    agree = all(a["tokens_first_request"] == b["tokens_first_request"] for a, b in zip(rows[::2], rows[1::2]))
    data = {**env_info(), "benchmark": "gpu-check", "device": torch.cuda.get_device_name(), "dtype": "bf16",
            "tests_passed": tests.returncode == 0, "tests_tail": tests.stdout[-2000:], "results": rows,
            "greedy_tokens_agree_graphs_on_off": agree}
    print(f"wrote {write_result(args.out, data)}")
    return 0 if tests.returncode == 0 and agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
