"""Training-step throughput: our GPT vs transformers' GPT2LMHeadModel, same config and batch, fp32 CPU.

    python -m bench.train [--rounds 6] [--steps 3] [--batch 8] [--threads 2]

One step = forward + loss + backward + gradient clipping + AdamW step + zero_grad, as
training/train.py does it (its `make_optimizer`: weight decay on matrices only). Both models
have the same shape (default 6 layers, 384 dims, 6 heads, context 256, vocabulary 4096,
dropout 0, tanh GELU) and see the same random batches. Rounds alternate which model goes first,
each round timing `--steps` steps of each; tokens/s is the median over rounds.

Writes bench/results/train.json and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any

import torch

from bench.common import env_info, median, print_table, set_threads, warn_contention, write_result


def make_ours(args):
    from model.config import GPTConfig
    from model.gpt import GPT

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.dims, dropout=0.0, bias=True)
    model = GPT(cfg).train()

    def loss_fn(x, y):
        return model(x, y)[1]

    return model, loss_fn


def make_hf(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.block, n_layer=args.layers, n_head=args.heads,
                     bos_token_id=None, eos_token_id=None,
                     n_embd=args.dims, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     activation_function="gelu_new")
    model = GPT2LMHeadModel(cfg).train()

    def loss_fn(x, y):
        # HF shifts the labels itself: labels = the inputs; the same (B, T, vocab) logits are computed
        return model(input_ids=x, labels=x).loss

    return model, loss_fn


def optimizer_for(model: torch.nn.Module, lr: float = 1e-3, wd: float = 0.1) -> torch.optim.Optimizer:
    try:  # the training pipeline's own optimizer construction, when it is there
        from types import SimpleNamespace

        from training.train import make_optimizer

        cfg = SimpleNamespace(weight_decay=wd, learning_rate=lr, beta1=0.9, beta2=0.99, optimizer="adamw")
        return make_optimizer(model, cfg, torch.device("cpu"))
    except (ImportError, AttributeError, TypeError):
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))


def train_steps(model, loss_fn, opt, batches, clip: float = 1.0) -> float:
    """Run the steps; returns seconds."""
    t = time.perf_counter()
    for x, y in batches:
        loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    loss.item()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3, help="steps per model per round")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--dims", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="train")
    args = ap.parse_args(argv)
    threads = set_threads(args.threads)
    info = env_info()
    warn_contention(info)

    torch.manual_seed(0)
    models = {"ours": make_ours(args), "hf": make_hf(args)}
    opts = {k: optimizer_for(m) for k, (m, _) in models.items()}
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, (m, _) in models.items()}
    g = torch.Generator().manual_seed(0)

    def batches(n):
        out = []
        for _ in range(n):
            x = torch.randint(0, args.vocab, (args.batch, args.block + 1), generator=g)
            out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
        return out

    for name, (m, f) in models.items():  # warm-up: allocator, optimizer state
        train_steps(m, f, opts[name], batches(2))
    tokens = args.batch * args.block * args.steps
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    for r in range(args.rounds):
        data = batches(args.steps)
        for name in (["ours", "hf"] if r % 2 == 0 else ["hf", "ours"]):
            gc.collect()
            m, f = models[name]
            times[name].append(train_steps(m, f, opts[name], data))
        print(f"round {r}: ours {tokens / times['ours'][-1]:.0f} tok/s, HF {tokens / times['hf'][-1]:.0f} tok/s, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)

    res: dict[str, Any] = {}
    for name in times:
        tps = [tokens / t for t in times[name]]
        res[name] = {"tok_s": round(median(tps), 1), "tok_s_all": [round(x, 1) for x in tps],
                     "step_ms": round(1000 * median(times[name]) / args.steps, 1), "params": n_params[name]}
    ratio = round(res["ours"]["tok_s"] / res["hf"]["tok_s"], 3)
    per_round = [round(h / o, 3) for o, h in zip(times["ours"], times["hf"])]  # paired: same round, same data
    print()
    print_table(["model", "params", "step ms", "tokens/s"],
                [[k, v["params"], v["step_ms"], v["tok_s"]] for k, v in res.items()])
    print(f"ours / HF: {ratio} (per-round ratios {per_round})")
    data = {**info, "benchmark": "train", "threads": threads,
            "config": {k: getattr(args, k) for k in ("batch", "block", "layers", "heads", "dims", "vocab")},
            "steps_per_round": args.steps, "rounds": args.rounds, "results": res, "ratio": ratio,
            "ratio_per_round": per_round, "ratio_per_round_median": median(per_round)}
    path = write_result(args.out, data)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
