"""Memory of scoring prompts (echo + logprobs, as lm-evaluation-harness asks) at the server's largest batch.

Every slot of the server's engine core gets a full-context prompt (block_size - 1 tokens) with prompt
log-probabilities and the top-1 alternative (lm-eval's `logprobs: 1`), scored only (`max_tokens: 0`) or with one
generated token (`max_tokens: 1`, lm-eval's request). The core is built as the server builds it
(`engine.build.build_core`: the same slots, prefill chunk, dtype and KV cache), so the numbers are the
server's. Reported, against the KV cache's budget (`engine.sizing.plan_slots`: per slot a full-length KV
cache plus a 4 MiB allowance for the sampler and a step's logits):

- the KV cache and the sampler's state (allocated at start),
- the peak memory above that while the batch is scored, and the same batch prefilled without log-probabilities,
- what a prompt x vocabulary logits tensor would have taken instead (vLLM #5907: per request, in fp32).

On CUDA the peak is torch.cuda.max_memory_allocated (exact); on a CPU it is the process's resident set sampled
every 2 ms (an upper bound: the allocator keeps freed pages). Writes bench/results/score-memory.json.

    python -m bench.score_memory                                 # random GPT-2 124M, the server's defaults
    python -m bench.score_memory --checkpoint checkpoints/shakespeare --max-batch-size 4   # a quick check
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import torch

from bench.common import env_info, print_table, random_gpt2, set_threads, write_result
from engine.sizing import SLOT_ALLOWANCE  # the per-slot allowance beside the KV cache


class PeakMemory:
    """Peak memory above the level at entry: CUDA's allocator statistics, or the CPU's resident set sampled."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = self.rss()
            self._high = self.base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._high = max(self._high, self.rss())
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._high, self.rss()) - self.base


def run_batch(core, n: int, prompt_len: int, vocab: int, max_new: int, prompt_logprobs: int | None,
              seed: int) -> dict:
    from engine.params import SamplingParams
    from engine.request import EngineRequest

    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        core.add(EngineRequest(f"r{seed}-{i}", prompt, SamplingParams(max_new_tokens=max_new, temperature=0),
                               seed=0, prompt_logprobs=prompt_logprobs))
    scored = 0
    t0 = time.perf_counter()
    with PeakMemory(core.device) as mem:
        while core.has_work():
            for out in core.step():
                if out.error is not None:
                    raise RuntimeError(out.message)
                if out.prompt_logprobs is not None:
                    scored += len(out.prompt_logprobs.logprobs) - 1
    return {"requests": n, "prompt_tokens": prompt_len, "max_new_tokens": max_new,
            "prompt_logprobs": prompt_logprobs, "scored_tokens": scored,
            "seconds": round(time.perf_counter() - t0, 3), "peak_extra_bytes": mem.peak}


def main(argv: list[str] | None = None) -> int:
    from engine.build import CoreConfig, build_core
    from engine.core import PROMPT_LOGPROBS_PIECE

    p = argparse.ArgumentParser(prog="python -m bench.score_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, help="default: a random GPT-2 124M (built once, cached)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-batch-size", type=int, help="default: the server's (fills the GPU's KV-cache budget; "
                   "32 on a CPU)")
    p.add_argument("--prefill-chunk", type=int, default=128, help="the server's default: 128")
    p.add_argument("--threads", type=int)
    p.add_argument("--name", default="score-memory", help="result file bench/results/NAME.json")
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    info = env_info()
    ckpt = args.checkpoint or random_gpt2()[1]
    cfg = CoreConfig(checkpoint=str(ckpt), device=args.device, dtype=args.dtype, torch_threads=threads,
                     max_batch_size=args.max_batch_size, prefill_chunk=args.prefill_chunk, warmup=True)
    core, core_info, _ = build_core(cfg)
    core.warmup()
    cfg_model = core.model.config
    slots, block, vocab = core.n_slots, core.max_len, core.vocab_size
    kv = core.cache.nbytes()
    sampler = sum(t.numel() * t.element_size() for t in vars(core.sampler).values() if isinstance(t, torch.Tensor))
    budget = slots * (kv // slots + SLOT_ALLOWANCE)
    prompt_len = block - 1  # the longest prompt the server takes (one position stays for a generated token)
    run_batch(core, slots, prompt_len, vocab, 1, 1, 0)  # unmeasured: the allocator grows to a full batch once
    runs = {
        "prefill_only": run_batch(core, slots, prompt_len, vocab, 1, None, 1),
        "score_only": run_batch(core, slots, prompt_len, vocab, 0, 1, 2),  # echo, max_tokens 0, logprobs 1
        "lm_eval": run_batch(core, slots, prompt_len, vocab, 1, 1, 3),  # echo, max_tokens 1, logprobs 1
    }
    elt = torch.empty((), dtype=core.dtype).element_size()
    naive_per_request = prompt_len * cfg_model.vocab_size * 4
    result = {
        "env": info, "checkpoint": str(ckpt), "device": str(core.device), "dtype": str(core.dtype),
        "slots": slots, "block_size": block, "vocab_size": vocab, "prefill_chunk": args.prefill_chunk,
        "n_params": core_info["n_params"], "kv_cache_bytes": kv, "sampler_bytes": sampler,
        "budget_bytes": budget, "slot_allowance_bytes": SLOT_ALLOWANCE,
        "naive_logits_bytes_per_request": naive_per_request,
        "naive_logits_bytes_chunk": args.prefill_chunk * cfg_model.vocab_size * elt,
        "scoring_piece_logits": PROMPT_LOGPROBS_PIECE,
        "runs": runs,
        "within_budget": {k: kv + sampler + r["peak_extra_bytes"] <= budget for k, r in runs.items()},
        "peak_note": "CUDA: max_memory_allocated above the level after warm-up; CPU: resident set sampled every 2 ms "
                     "above the level before the batch (an upper bound)",
    }
    path = write_result(args.name, result)
    mib = 1 / 2**20
    print(f"{slots} slots x {prompt_len}-token prompts, vocab {vocab}, {core.device} {core.dtype}: KV cache "
          f"{kv * mib:.1f} MiB, sampler {sampler * mib:.1f} MiB, budget {budget * mib:.1f} MiB; a prompt x vocab "
          f"fp32 tensor would be {naive_per_request * mib:.1f} MiB per request")
    print_table(["run", "peak above start (MiB)", "KV + sampler + peak <= budget", "seconds", "scored tokens"],
                [[k, r["peak_extra_bytes"] * mib, result["within_budget"][k], r["seconds"], r["scored_tokens"]]
                 for k, r in runs.items()])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
