"""The draw inside the compiled decode step (engine/plain_draw.py) against the compiled step's logits handed to the
eager sampler, per sampling setting, paired and interleaved in one engine core (the same packages, cache and
requests; only `Sampler.plain_kind` differs). Reports each setting's median step time both ways, their ratio and
whether the tokens were the same.

    python -m bench.fused_draw --threads 1 --rounds 8 --out fused-draw

"before" routes top-p and top-k rows to the eager sampler, as the engine did before they were drawn inside the
step; greedy and T = 1 rows are inside the step both ways (their ratio is the noise floor).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import REPO, env_info, write_result

CASES = {
    "greedy": dict(temperature=0.0),
    "t1": dict(temperature=1.0),
    "t0.8_top_p0.95": dict(temperature=0.8, top_p=0.95),
    "llama_defaults_t0.8_top_k40_top_p0.95": dict(temperature=0.8, top_k=40, top_p=0.95),
    "t1_top_k50": dict(temperature=1.0, top_k=50),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=str(REPO / "checkpoints" / "shakespeare"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens", type=int, default=150)
    p.add_argument("--out", default="fused-draw")
    args = p.parse_args(argv)

    from engine.build import CoreConfig, build_core
    from engine.params import SamplingParams
    from engine.request import EngineRequest

    cfg = CoreConfig(checkpoint=args.checkpoint, device="cpu", dtype="fp32", quantize="none", compile="on",
                     torch_threads=args.threads)
    core, _, _ = build_core(cfg)
    core.warmup()
    if not (core.wait_compiled(1800) and core.stats()["compiled_decode"]):
        print(f"error: the decode step did not compile: {core.stats().get('compile_error')}")
        return 1
    sampler = core.sampler
    fused = sampler.plain_kind

    def before(slots):
        kind = fused(slots)
        return None if kind == "top_k" or any(sampler.state.kinds[s].top_p for s in slots) else kind

    times = {c: {"fused": [], "before": []} for c in CASES}
    same = {c: True for c in CASES}
    for r in range(args.rounds):
        for c, kw in CASES.items():
            tokens = []
            for mode in (("fused", "before") if r % 2 == 0 else ("before", "fused")):
                sampler.plain_kind = fused if mode == "fused" else before
                params = SamplingParams(max_new_tokens=args.tokens, stop_at_eos=False, **kw)
                core.add(EngineRequest(f"{c}-{mode}-{r}", list(range(10, 42)), params, seed=r))
                steps, out = [], []
                while core.has_work():
                    t0 = time.perf_counter()
                    for o in core.step():
                        out += o.token_ids
                    steps.append(time.perf_counter() - t0)
                times[c][mode].append(statistics.median(steps[2:]) * 1000)  # after the prefill and first decode
                tokens.append(out)
            same[c] &= tokens[0] == tokens[1]
    sampler.plain_kind = fused
    summary = {}
    for c in CASES:
        f, b = times[c]["fused"], times[c]["before"]
        summary[c] = {"fused_ms": round(statistics.median(f), 3), "before_ms": round(statistics.median(b), 3),
                      "ratio_median": round(statistics.median(x / y for x, y in zip(f, b)), 3),
                      "same_tokens": same[c]}
        print(c, summary[c], flush=True)
    data = {"env": env_info(), "checkpoint": args.checkpoint, "threads": args.threads, "rounds": args.rounds,
            "tokens": args.tokens, "compile_source": core.stats()["compile_source"], "summary": summary,
            "ms": times}
    print(f"wrote {write_result(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
