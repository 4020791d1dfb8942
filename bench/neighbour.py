"""The compiled batch-1 step beside work on the other CPU: the engine core pinned to one CPU, greedy 200-token
requests, alone and beside a process on another CPU that spins or that allocates Python objects (as the HTTP front
and a client do). Shows how much of a served token's cost is the neighbour evicting the weights from a shared L3.

    taskset -c 0 python -m bench.neighbour --neighbour-cpu 1 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from bench.common import REPO, env_info, write_result

NEIGHBOURS = {"alone": None, "spin": "while True:\n    pass",
              "python-alloc": "while True:\n    x = [str(i) for i in range(200000)]"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=str(REPO / "checkpoints" / "shakespeare"))
    p.add_argument("--neighbour-cpu", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile", default="on")
    p.add_argument("--out", default="neighbour")
    args = p.parse_args(argv)

    from engine.build import CoreConfig, build_core
    from engine.params import SamplingParams
    from engine.request import EngineRequest

    cfg = CoreConfig(checkpoint=args.checkpoint, device="cpu", dtype="fp32", quantize="none", compile=args.compile,
                     torch_threads=1)
    core, _, _ = build_core(cfg)
    core.warmup()
    core.wait_compiled(1800)

    def step_ms(tag: str) -> float:
        core.add(EngineRequest(tag, list(range(10, 42)), SamplingParams(max_new_tokens=200, temperature=0,
                                                                        stop_at_eos=False), seed=1))
        steps = []
        while core.has_work():
            t0 = time.perf_counter()
            core.step()
            steps.append(time.perf_counter() - t0)
        return statistics.median(steps[2:]) * 1000  # after the prefill and the first decode

    ms: dict[str, list[float]] = {k: [] for k in NEIGHBOURS}
    for r in range(args.rounds):
        for name, code in NEIGHBOURS.items():
            proc = None
            if code is not None:
                proc = subprocess.Popen(["taskset", "-c", str(args.neighbour_cpu), sys.executable, "-c", code])
                time.sleep(0.5)
            try:
                ms[name].append(round(step_ms(f"{name}-{r}"), 3))
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
    for name, v in ms.items():
        print(f"{name}: step {v} ms (median {statistics.median(v):.3f})")
    data = {"env": env_info(), "checkpoint": args.checkpoint, "compiled_decode": core.stats()["compiled_decode"],
            "neighbour_cpu": args.neighbour_cpu, "ms": ms}
    print(f"wrote {write_result(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
