"""The models bench/speculative.py needs that this repo does not ship, trained here in minutes on one CPU thread:

- **copy model**: the bundled model (checkpoints/shakespeare, 4 layers) fine-tuned to repeat a passage it was just
  shown. The bundled model cannot (its greedy continuation of a repeated passage leaves it at once): it learns it
  from tinyshakespeare passages followed by "\\n\\nAgain:\\n" and the passage again (one in five with a word
  swapped for another of the passage, the "small edits"), packed into 256-token rows.
- **draft model**: a 1-layer, 128-wide model with the bundled tokenizer, trained from scratch on tinyshakespeare
  (plain text and the same copy rows, half each): a small draft beside the 4-layer target.

    python -m bench.spec_models [--seconds 300] [--threads 1]   # builds both (cached; --force rebuilds)

Checkpoints go to ~/.cache/gpt-serve-bench/spec-copy and spec-draft (BENCH_CACHE); their metadata.json says how
they were made (steps, seconds, losses).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from bench.common import CACHE, REPO, set_threads

BUNDLED = REPO / "checkpoints" / "shakespeare"
RANKS = BUNDLED / "shakespeare.tiktoken"
DATA = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
COPY_DIR, DRAFT_DIR = CACHE / "spec-copy", CACHE / "spec-draft"
GPT2_DRAFT_DIR = CACHE / "spec-gpt2-draft-2l"  # random GPT-2 124M's first 2 blocks (build_truncated)
SEPARATOR = "\n\nAgain:\n"
BLOCK = 256


def corpus(tokenizer) -> tuple[list[int], list[int]]:
    """tinyshakespeare's ids: the first 90% (training) and the last 10% (the benchmark's passages), as the bundled
    model's split."""
    text = DATA.read_text()
    cut = int(len(text) * 0.9)
    return tokenizer.encode(text[:cut]), tokenizer.encode(text[cut:])


def copy_example(ids: list[int], sep: list[int], rng: random.Random, n: int | None = None,
                 edit: bool | None = None) -> tuple[list[int], list[int]]:
    """(prompt, answer): a passage of n tokens and the separator, then the passage again; with `edit` one word of it
    swapped for another of the passage everywhere it appears (a name changed)."""
    n = n or rng.randint(24, 110)
    at = rng.randrange(0, len(ids) - n)
    passage = ids[at:at + n]
    answer = list(passage)
    if edit if edit is not None else rng.random() < 0.2:
        a, b = rng.sample(sorted(set(passage)), 2) if len(set(passage)) > 1 else (passage[0], passage[0])
        answer = [b if t == a else t for t in answer]
    return passage + sep, answer


def copy_rows(ids, sep, eot: int, rng: random.Random, rows: int, block: int = BLOCK) -> torch.Tensor:
    out = []
    for _ in range(rows):
        row: list[int] = []
        while len(row) < block + 1:
            prompt, answer = copy_example(ids, sep, rng)
            row += prompt + answer + [eot]
        out.append(row[:block + 1])
    return torch.tensor(out)


def text_rows(ids, rng: random.Random, rows: int) -> torch.Tensor:
    starts = [rng.randrange(0, len(ids) - BLOCK - 1) for _ in range(rows)]
    return torch.tensor([ids[s:s + BLOCK + 1] for s in starts])


def train(model, batches, seconds: float, lr: float, max_steps: int) -> dict:
    for m in model.modules():  # no dropout: minutes of training, not hours
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if hasattr(m, "dropout") and isinstance(m.dropout, float):
            m.dropout = 0.0
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    t0, step, losses = time.perf_counter(), 0, []
    while step < max_steps and time.perf_counter() - t0 < seconds:
        x = batches(step)
        _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 50 == 0:
            print(f"  step {step} loss {sum(losses[-50:]) / 50:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    model.eval()
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "lr": lr,
            "final_loss": round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4)}


def build_copy(seconds: float, force: bool = False, more: bool = False) -> Path:
    """`more`: train the saved copy model further (its metadata adds up the runs)."""
    from model.checkpoint import load_checkpoint, save_checkpoint

    exists = (COPY_DIR / "config.json").is_file()
    if exists and not force and not more:
        return COPY_DIR
    ck = load_checkpoint(COPY_DIR if exists and more else BUNDLED)
    earlier = []
    if exists and more:
        m = ck.metadata
        earlier = m.get("runs") or [{k: m[k] for k in ("steps", "seconds", "lr", "final_loss") if k in m}]
    tok = ck.tokenizer
    train_ids, _ = corpus(tok)
    sep = tok.encode(SEPARATOR)
    rng = random.Random(0)
    print(f"copy model: fine-tuning {COPY_DIR if earlier else BUNDLED} for up to {seconds:.0f} s")
    # 1e-3: at 3e-4 the loss had barely moved after 150 steps (3.73 -> 3.65); copying is learnt in a jump
    run = train(ck.model, lambda step: copy_rows(train_ids, sep, tok.eot_id, rng, 8, 160), seconds, 1e-3, 100_000)
    runs = earlier + [run]
    meta = {"made_by": "python -m bench.spec_models", "from": "checkpoints/shakespeare", "task": "copy",
            "data": f"tinyshakespeare first 90%: passages of 24-110 tokens, {SEPARATOR!r}, the passage again "
                    "(1 in 5 with one word swapped), packed into 160-token rows, batch 8", "runs": runs,
            "steps": sum(r["steps"] for r in runs), "seconds": round(sum(r["seconds"] for r in runs), 1),
            "final_loss": run["final_loss"]}
    return save_checkpoint(COPY_DIR, ck.model, tok, meta, tokenizer_file=RANKS)


def build_draft(seconds: float, force: bool = False) -> Path:
    from model.checkpoint import load_checkpoint, save_checkpoint
    from model.config import GPTConfig
    from model.gpt import GPT

    if (DRAFT_DIR / "config.json").is_file() and not force:
        return DRAFT_DIR
    tok = load_checkpoint(BUNDLED).tokenizer
    train_ids, _ = corpus(tok)
    sep = tok.encode(SEPARATOR)
    rng = random.Random(1)
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=BLOCK, n_layer=1, n_head=2, n_embd=128,
                          dropout=0.0))
    print(f"draft model: training 1 layer x 128 from scratch for up to {seconds:.0f} s")

    def batches(step: int) -> torch.Tensor:
        return copy_rows(train_ids, sep, tok.eot_id, rng, 8) if step % 2 else text_rows(train_ids, rng, 8)

    run = train(model, batches, seconds, 2e-3, 100_000)
    meta = {"made_by": "python -m bench.spec_models", "task": "draft", "n_layer": 1, "n_embd": 128,
            "data": "tinyshakespeare first 90%: plain 256-token rows and copy rows, alternating, batch 8", **run}
    return save_checkpoint(DRAFT_DIR, model, tok, meta, tokenizer_file=RANKS)


def build_truncated(src: Path, n_layer: int, out: Path, force: bool = False) -> Path:
    """A draft made of a model's own first `n_layer` blocks, its final LayerNorm and tied head (LayerSkip's early
    exit as a separate checkpoint): same tokenizer, no training. For random GPT-2 124M (bench.common.random_gpt2),
    whose residual stream the small random blocks barely turn, it agrees with the full model's greedy choice most of
    the time: a read-bound target with a draft, where no trained pair with GPT-2's tokenizer is at hand offline."""
    import dataclasses

    from model.checkpoint import load_checkpoint, save_checkpoint
    from model.gpt import GPT

    if (out / "config.json").is_file() and not force:
        return out
    ck = load_checkpoint(src)
    model = GPT(dataclasses.replace(ck.config, n_layer=n_layer)).eval()
    state = {k: v for k, v in ck.model.state_dict().items()
             if not k.startswith("transformer.h.") or int(k.split(".")[2]) < n_layer}
    model.load_state_dict(state)
    meta = {"made_by": "python -m bench.spec_models", "task": "draft",
            "from": f"{src}: its first {n_layer} of {ck.config.n_layer} blocks, ln_f and the tied head"}
    return save_checkpoint(out, model, ck.tokenizer, meta)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300, help="training time per model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument("--only", choices=["copy", "draft", "gpt2-draft"], default=None)
    ap.add_argument("--more", action="store_true", help="train the saved copy model further")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    if args.only in (None, "copy"):
        print(build_copy(args.seconds, args.force, args.more))
    if args.only in (None, "draft"):
        print(build_draft(args.seconds, args.force))
    if args.only in (None, "gpt2-draft"):
        from bench.common import random_gpt2

        print(build_truncated(random_gpt2()[1], 2, GPT2_DRAFT_DIR, args.force))


if __name__ == "__main__":
    main()
