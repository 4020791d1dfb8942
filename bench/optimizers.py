"""Optimizers at the bundled model's shape: our AdamW recipe vs Muon (`optimizer=muon`) vs nanoGPT's own model.py +
configure_optimizers (AdamW), on the same data, batches, tokens and schedule, interleaved in one process.

    python -m bench.optimizers --data data/shakespeare --steps 200 --seeds 1337 1338 \\
        [--nanogpt /path/to/nanoGPT/model.py] [--set muon_lr=0.02 ...]

The recipe is training/configs/shakespeare.json with max_iters = --steps and warmup_iters scaled with it (100 of
1500), so a short run is the recipe's schedule compressed; `--set` changes any TrainConfig key of every
contender (`--muon-set` of the Muon one only). nanoGPT is not vendored: pass the path of its model.py
(a clone of github.com/karpathy/nanoGPT); without it that contender is left out. Every contender of a seed starts
from its own seeded init and sees the same training batches (training.lm.data.BatchSampler) and the same fixed
validation windows; each keeps its own dropout RNG. They take turns of --chunk steps (the order rotates), so a
busy neighbour slows them alike.

Costs are CPU-seconds of this process (time.process_time, one torch thread), counted over training steps only
(evaluations excluded); wall-clock on the shared machine is not reported, it measures the neighbours. Reported:
validation loss against tokens and CPU-seconds (JSON and a plot), the tokens and CPU-seconds at which each
contender first reaches AdamW's final validation loss (linear between evaluations), and the CPU time per step
and per optimizer step (Muon's Newton-Schulz cost).

Writes bench/results/<--out>.json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import REPO, RESULTS, env_info, median, print_table, set_threads, write_result
from model.config import GPTConfig
from model.gpt import GPT
from training.config import TrainConfig, build_config
from training.distributed import Dist
from training.lm.data import BatchSampler, fixed_eval_offsets, open_data_dir
from training.lm.measure import estimate_loss
from training.optim import lr_at, make_optimizer, split_params

RECIPE = REPO / "training" / "configs" / "shakespeare.json"


@dataclass
class Contender:
    """One model + optimizer being trained, with its own dropout RNG and what it has cost so far."""

    name: str
    seed: int
    model: torch.nn.Module
    step_fn: Callable[[int], None]  # set this step's learning rate (and momentum)
    optimizer: Any
    rng: torch.Tensor
    cpu_s: float = 0.0
    opt_cpu_s: float = 0.0
    step_cpu: list[float] = field(default_factory=list)  # CPU seconds per step, one entry per turn
    evals: list[dict[str, float]] = field(default_factory=list)


def load_nanogpt(path: str):
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ours(name: str, cfg: TrainConfig, vocab: int, seed: int) -> Contender:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                          n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias)).train()
    opt = make_optimizer(model, cfg, torch.device("cpu"))
    return Contender(name, seed, model, lambda step: opt.schedule(step, cfg), opt, torch.get_rng_state())


class Contiguous(torch.nn.Module):
    """nanoGPT's forward views its targets, so it needs contiguous ones; our window batches are slices."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return self.model(x.contiguous(), y.contiguous())


def nanogpt(mod, cfg: TrainConfig, vocab: int, seed: int) -> Contender:
    torch.manual_seed(seed)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter counts
        model = mod.GPT(mod.GPTConfig(block_size=cfg.block_size, vocab_size=vocab, n_layer=cfg.n_layer,
                                      n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout,
                                      bias=cfg.bias)).train()
        opt = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), "cpu")

    def step_fn(step: int) -> None:  # nanoGPT's get_lr is the same warmup + cosine formula as training.optim.lr_at
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)

    return Contender("nanogpt", seed, Contiguous(model), step_fn, opt, torch.get_rng_state())


def run_turn(c: Contender, sampler: BatchSampler, start: int, n: int, clip: float) -> None:
    """n training steps of c from `start`, with c's own dropout RNG; adds their CPU time to c."""
    torch.set_rng_state(c.rng)
    t0, opt_s = time.process_time(), 0.0
    for step in range(start, start + n):
        c.step_fn(step)
        x, y = sampler.batch(step)
        _, loss = c.model(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(c.model.parameters(), clip)
        t1 = time.process_time()
        c.optimizer.step()
        opt_s += time.process_time() - t1
        c.optimizer.zero_grad(set_to_none=True)
    spent = time.process_time() - t0
    c.cpu_s += spent
    c.opt_cpu_s += opt_s
    c.step_cpu.append(spent / n)
    c.rng = torch.get_rng_state()


def reach(evals: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """Tokens and CPU-seconds where the validation loss first falls to target (linear between evaluations)."""
    for a, b in zip(evals, evals[1:]):
        if b["val_loss"] <= target:
            f = 1.0 if a["val_loss"] <= target else (a["val_loss"] - target) / (a["val_loss"] - b["val_loss"])
            return {k: a[k] + f * (b[k] - a[k]) for k in ("tokens", "cpu_s")}
    return None


def plot(results: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = {"adamw": "tab:blue", "muon": "tab:red", "nanogpt": "tab:green"}
    for name, runs in results.items():
        for i, r in enumerate(runs):
            ev = r["evals"][1:]  # step 0 (about ln(vocab)) squashes the interesting part
            for ax, key, scale in ((axes[0], "tokens", 1e6), (axes[1], "cpu_s", 1.0)):
                ax.plot([e[key] / scale for e in ev], [e["val_loss"] for e in ev], color=colors.get(name),
                        alpha=0.9 if i == 0 else 0.5, label=f"{name} seed {r['seed']}")
    axes[0].set_xlabel("training tokens (M)")
    axes[1].set_xlabel("training CPU-seconds (1 thread)")
    axes[0].set_ylabel("validation loss (nats/token)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def newton_schulz_cost(cfg: TrainConfig, vocab: int, repeats: int = 3) -> dict[str, Any]:
    """CPU-seconds of one Muon step's orthogonalisations (all block matrices of the model, ns_steps iterations):
    torch.optim.Muon's own (bf16) vs training.optim's (fp32 on a CPU), best of `repeats`."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from training.optim import _newton_schulz

    model = GPT(GPTConfig(vocab_size=vocab, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                          n_embd=cfg.n_embd, bias=cfg.bias))
    grads = [torch.randn_like(p) for p in split_params(model)[0]]
    coef, steps, eps = (3.4445, -4.775, 2.0315), 5, 1e-7
    ways = {"torch_bf16": lambda g: _zeropower_via_newtonschulz(g, coef, steps, eps),
            "ours_fp32": lambda g: _newton_schulz(g, coef, steps, eps)}
    out: dict[str, Any] = {"matrices": [list(g.shape) for g in grads], "ns_steps": steps}
    for name, fn in ways.items():
        best = float("inf")
        for _ in range(repeats):
            t = time.process_time()
            for g in grads:
                fn(g)
            best = min(best, time.process_time() - t)
        out[f"{name}_cpu_s"] = round(best, 4)
    out["bf16_over_fp32"] = round(out["torch_bf16_cpu_s"] / out["ours_fp32_cpu_s"], 1)
    return out


def report(args: argparse.Namespace, info: dict[str, Any], cfg: TrainConfig, muon_cfg: TrainConfig, eval_windows: int,
           results: dict[str, list[dict]]) -> None:
    """The summary table, bench/results/<out>.json and the plot, for the seeds done so far."""
    threads, tokens_per_step = args.threads, cfg.batch_size * cfg.block_size
    summary: dict[str, Any] = {}
    for name, runs in results.items():
        rows = []
        for r, a in zip(runs, results["adamw"]):
            target = a["evals"][-1]["val_loss"]
            hit = reach(r["evals"], target)
            rows.append({"seed": r["seed"], "final_val_loss": r["evals"][-1]["val_loss"], "adamw_final": target,
                         "reach_adamw_final": hit and {k: round(v, 1) for k, v in hit.items()},
                         "tokens_ratio": hit and round(hit["tokens"] / a["evals"][-1]["tokens"], 3),
                         "cpu_ratio": hit and round(hit["cpu_s"] / a["cpu_s"], 3),
                         "step_speed_vs_adamw": round(a["step_cpu_ms"] / r["step_cpu_ms"], 3)})
        summary[name] = {
            "per_seed": rows,
            "mean_final_val_loss": round(sum(x["final_val_loss"] for x in rows) / len(rows), 4),
            "step_cpu_ms": median([r["step_cpu_ms"] for r in runs]),
            "optimizer_step_cpu_ms": median([r["optimizer_step_cpu_ms"] for r in runs]),
        }
    print()
    print_table(["optimizer", "final val (mean)", "step CPU ms", "opt.step CPU ms", "tokens to AdamW final",
                 "CPU-s to AdamW final"],
                [[k, v["mean_final_val_loss"], v["step_cpu_ms"], v["optimizer_step_cpu_ms"],
                  " ".join(str(x["tokens_ratio"]) for x in v["per_seed"]),
                  " ".join(str(x["cpu_ratio"]) for x in v["per_seed"])] for k, v in summary.items()])
    out = {**info, "benchmark": "optimizers", "threads": threads, "steps": args.steps,
           "seeds": [r["seed"] for r in results["adamw"]],
           "tokens_per_step": tokens_per_step, "eval_windows": eval_windows, "chunk": args.chunk,
           "nanogpt": args.nanogpt, "config": cfg.to_dict(), "muon_config": muon_cfg.to_dict(),
           "summary": summary, "runs": results}
    path = write_result(args.out, out)
    png = RESULTS / f"{args.out}.png"
    plot(results, png, f"bundled model's shape, {args.steps} steps x {tokens_per_step} tokens, 1 thread")
    print(f"wrote {path} and {png}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.optimizers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a training.prepare directory (the bundled model's data)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338])
    ap.add_argument("--eval-interval", type=int, default=25)
    ap.add_argument("--chunk", type=int, default=5, help="steps per turn")
    ap.add_argument("--nanogpt", metavar="MODEL_PY", help="nanoGPT's model.py (not vendored); omit to skip it")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="every contender's config")
    ap.add_argument("--muon-set", action="append", default=[], metavar="KEY=VALUE", help="the Muon run's config")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="optimizers")
    ap.add_argument("--newton-schulz", action="store_true",
                    help="only time one step's Newton-Schulz iterations, torch's bf16 vs ours in fp32 "
                         "(writes bench/results/<--out>-newton-schulz.json)")
    args = ap.parse_args(argv)
    if args.steps % args.chunk or args.eval_interval % args.chunk:
        ap.error("--steps and --eval-interval must be multiples of --chunk")
    set_threads(args.threads)
    info = env_info()
    data = open_data_dir(args.data)
    vocab = data.tokenizer.vocab_size
    base = [f"max_iters={args.steps}", f"warmup_iters={max(1, round(100 * args.steps / 1500))}", *args.set]
    cfg = build_config(file=RECIPE, overrides=base)
    muon_cfg = build_config(file=RECIPE, overrides=[*base, "optimizer=muon", *args.muon_set])
    if args.newton_schulz:
        ns = newton_schulz_cost(cfg, vocab)
        print(ns)
        print(f"wrote {write_result(f'{args.out}-newton-schulz', {**info, 'threads': args.threads, **ns})}")
        return 0
    mod = load_nanogpt(args.nanogpt) if args.nanogpt else None
    offsets = fixed_eval_offsets(len(data.val), cfg.block_size, cfg.batch_size, cfg.eval_iters)
    tokens_per_step = cfg.batch_size * cfg.block_size

    results: dict[str, list[dict]] = {}
    for seed in args.seeds:
        contenders = [ours("adamw", cfg, vocab, seed), ours("muon", muon_cfg, vocab, seed)]
        if mod is not None:
            contenders.append(nanogpt(mod, cfg, vocab, seed))
        sampler = BatchSampler(data.train, cfg.block_size, cfg.batch_size, seed)
        for turn, start in enumerate(range(0, args.steps + 1, args.chunk)):
            order = contenders[turn % len(contenders):] + contenders[:turn % len(contenders)]
            for c in order:
                if start % args.eval_interval == 0:
                    with torch.no_grad():
                        val = estimate_loss(c.model, data.val, offsets, cfg.block_size, torch.device("cpu"),
                                            contextlib.nullcontext, Dist())
                    c.evals.append({"step": start, "tokens": start * tokens_per_step, "cpu_s": round(c.cpu_s, 2),
                                    "val_loss": round(val, 5)})
                if start < args.steps:
                    run_turn(c, sampler, start, args.chunk, cfg.grad_clip)
            if start % args.eval_interval == 0:
                print(f"seed {seed} step {start}: " + ", ".join(
                    f"{c.name} {c.evals[-1]['val_loss']:.4f} ({c.cpu_s:.0f} CPU-s)" for c in contenders), flush=True)
        for c in contenders:
            results.setdefault(c.name, []).append({
                "seed": seed, "evals": c.evals, "cpu_s": round(c.cpu_s, 2),
                "step_cpu_ms": round(1000 * median(c.step_cpu), 1),
                "optimizer_step_cpu_ms": round(1000 * c.opt_cpu_s / args.steps, 1)})

        # after every seed, so that a run cut short still leaves its finished seeds
        report(args, info, cfg, muon_cfg, int(offsets.size), results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
