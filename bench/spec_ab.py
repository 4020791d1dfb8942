"""Speculation off and n-gram, alternating in one process, with each core step's wall time by kind.

    python -m bench.spec_ab [--workload chat|repeat|copy] [--rounds 6] [--threads 2] [--name spec-ab]

bench.speculative's workloads and cores (built as the server builds them, compiled as `auto`, waited for); the two
cores run the workload's requests in turn, the order reversed every other round, so a drifting host hits both
alike. Per core: decode tok/s of each round, and the median wall time of its plain steps and of its speculative
steps (proposals, verification pass, draws), which is where a speculating core's time goes; ratios are n-gram ÷ off
of the same round. Writes bench/results/NAME.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import env_info, set_threads, write_result


def main(argv: list[str] | None = None) -> None:
    from bench.speculative import build, run_batch1, workloads

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--name", default="spec-ab")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    w = workloads(False, None, None)[args.workload]
    cores = {m: build(w["target"], m, None, args.k, 4, 4, 0.0) for m in ("off", "ngram")}
    times: dict[str, dict[str, list[float]]] = {m: {"plain": [], "speculative": []} for m in cores}
    for m, (core, _) in cores.items():
        step = core.step

        def timed(core=core, step=step, m=m):
            spec = core.speculator
            before = spec.steps if spec else 0
            t0 = time.perf_counter()
            out = step()
            times[m]["speculative" if spec and spec.steps > before else "plain"].append(time.perf_counter() - t0)
            return out

        core.step = timed
    runs: dict[str, list[float]] = {m: [] for m in cores}
    for r in range(args.rounds):
        for m in (["off", "ngram"] if r % 2 == 0 else ["ngram", "off"]):
            core, tok = cores[m]
            runs[m].append(round(run_batch1(core, tok, w["requests"])["decode_tok_s"], 1))
    result = {"benchmark": "spec-ab", "env": env_info(), "workload": args.workload, "rounds": args.rounds,
              "k": args.k, "ratios": [round(b / a, 3) for a, b in zip(runs["off"], runs["ngram"])]}
    for m, (core, _) in cores.items():
        result[m] = {"decode_tok_s": runs[m], "median": statistics.median(runs[m]),
                     "steps": {k: {"count": len(v), "median_ms": round(1000 * statistics.median(v), 3)}
                               for k, v in times[m].items() if v},
                     "speculative": core.stats().get("speculative")}
    print(f"{args.workload}: n-gram / off by round {result['ratios']}, median "
          f"{statistics.median(result['ratios']):.3f}")
    for m in cores:
        print(f"  {m}: tok/s {runs[m]}; steps {result[m]['steps']}")
    print(write_result(args.name, result))


if __name__ == "__main__":
    main()
