"""The chat fine-tuning demonstration's two measurements (docs/training.md).

    python -m training.chat.measure loss --base checkpoints/shakespeare --tuned runs/chat/best --val val.jsonl
    python -m training.chat.measure throughput --checkpoint checkpoints/shakespeare --train train.jsonl \\
        --text ../shared/data/tinyshakespeare.txt [--rounds 4 --steps 10]

`loss`: on held-out conversations, the assistant-token loss of the fine-tuned checkpoint rendered with its own
template, against the base checkpoint prompted with the server's `You:` / `Model:` transcript (what a base
model's /v1/chat/completions renders) on the same turns. Each model's prompt and reply tokens are what the
server would send it (training/chat/encoding.py's segments, model/chat_template.py's templates); the reply
ends with what the template writes after it (`<|endoftext|>`, which ends the turn; the transcript's newline,
which does not: the server stops a transcript reply at "\nYou:", so `base_with_stop` also counts the "You:" a
base model must write to end its turn). Reported per token (each with its own tokens) and per byte of the
replies' text (the same bytes for both). Conversations either model cannot fit in its context are left out of
all figures.

`throughput`: chat training steps against language-model training steps on the same model, interleaved
(--rounds of --steps each, one thread, after a warm-up), on the same shapes: each LM batch has the rows and
length of the chat batch before it, windows of the tokenized text with every position a target. What differs
is only the batch source (conversations read from the token file and padded vs windows of a token array) and
the targets (-1 off the replies), so the ratio is the mask's and the loader's cost. Positions per second.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from model.chat_template import ChatTemplate, load_chat_template, template_special_tokens
from model.checkpoint import load_checkpoint
from model.special_tokens import add_special_tokens
from model.tokenizer import EOT
from training.chat.data import TokenDir, chat_batch, encode_chat_file, parse_conversation
from training.chat.encoding import ChatEncoder, Message
from training.chat.finetune import training_template
from training.config import FinetuneConfig
from training.optim import make_optimizer

PROG = "python -m training.chat.measure"


@torch.no_grad()
def reply_loss(model, encoder: ChatEncoder, conversations: list[list[Message]],
               then: list[int] = ()) -> list[tuple[float, int]]:
    """(summed nats, learned tokens) of each conversation; None where it does not fit the context.
    then: tokens appended to the conversation and learned too (what ends a transcript's reply)."""
    block = model.config.block_size
    device = next(model.parameters()).device
    out = []
    for msgs in conversations:
        ids, learn = encoder.encode(msgs)
        ids, learn = ids + list(then), learn + [True] * len(then)
        if len(ids) > block + 1:
            out.append(None)
            continue
        x = torch.tensor(ids[:-1], device=device)[None]
        y = torch.tensor([i if f else -1 for i, f in zip(ids[1:], learn[1:])], device=device)[None]
        logits, _ = model(x)
        ce = F.cross_entropy(logits[0].float(), y[0], ignore_index=-1, reduction="sum")
        out.append((ce.item(), int((y >= 0).sum())))
    return out


def compare_loss(base_dir: str, tuned_dir: str, val: str) -> dict:
    base, tuned = load_checkpoint(base_dir), load_checkpoint(tuned_dir)
    transcript = load_chat_template(base_dir, EOT)  # a base model's /v1/chat/completions template
    own = load_chat_template(tuned_dir, EOT)
    convs = [parse_conversation(json.loads(line)) for line in Path(val).read_text(encoding="utf-8").splitlines()
             if line.strip()]
    a = reply_loss(base.model, ChatEncoder(transcript, base.tokenizer), convs)
    # the transcript's reply ends in a newline that does not end the turn: the server stops at "\nYou:", so a
    # base model that ends its turn writes "You:" after that newline; counted here as a second base figure
    stop = base.tokenizer.encode(transcript.stop[0].removeprefix("\n")) if transcript.stop else []
    a_stop = reply_loss(base.model, ChatEncoder(transcript, base.tokenizer), convs, then=stop)
    b = reply_loss(tuned.model, ChatEncoder(own, tuned.tokenizer), convs)
    keep = [i for i in range(len(convs)) if a_stop[i] is not None and b[i] is not None]
    reply_bytes = sum(len(m.content.strip().encode()) + 1 for i in keep for m in convs[i] if m.weight == 1)

    def summary(r, template: ChatTemplate) -> dict:
        nats, n = sum(r[i][0] for i in keep), sum(r[i][1] for i in keep)
        return {"template": template.origin, "nats_per_token": nats / n, "tokens": n,
                "nats_per_byte": nats / reply_bytes}

    res = {"conversations": len(keep), "left_out": len(convs) - len(keep), "reply_bytes": reply_bytes,
           "base": summary(a, transcript), "base_with_stop": summary(a_stop, transcript),
           "tuned": summary(b, own),
           "tuned_cpu_s": tuned.metadata.get("cpu_s"), "tuned_step": tuned.metadata.get("step")}
    res["lower_per_token"] = 1 - res["tuned"]["nats_per_token"] / res["base"]["nats_per_token"]
    res["lower_per_byte"] = 1 - res["tuned"]["nats_per_byte"] / res["base"]["nats_per_byte"]
    res["lower_per_token_with_stop"] = 1 - res["tuned"]["nats_per_token"] / res["base_with_stop"]["nats_per_token"]
    res["lower_per_byte_with_stop"] = 1 - res["tuned"]["nats_per_byte"] / res["base_with_stop"]["nats_per_byte"]
    return res


def throughput(checkpoint: str, train: str, text: str, rounds: int, steps: int, batch_size: int) -> dict:
    torch.set_num_threads(1)
    ck = load_checkpoint(checkpoint)
    model = ck.model
    template = training_template(ck.path, None)
    tok = add_special_tokens(model, ck.tokenizer, template_special_tokens(template))  # as chat/finetune.py adds them
    model.train()
    cfg = FinetuneConfig(batch_size=batch_size, learning_rate=1e-5, min_lr=1e-6)
    opt = make_optimizer(model, cfg, torch.device("cpu"))
    corpus = np.asarray(ck.tokenizer.encode(Path(text).read_text(encoding="utf-8"), allow_special=False),
                        dtype=np.int64)
    rng = np.random.default_rng(0)
    with TokenDir() as wd:
        data = encode_chat_file(train, ChatEncoder(template, tok), ck.config.block_size, "drop", wd)
        order = rng.permutation(len(data))

        def chat(k: int):
            rows = [data.example(int(i)) for i in order[(k * batch_size) % len(data):][:batch_size]]
            return chat_batch(rows, tok.eot_id)

        def lm(shape):
            B, T = shape
            offs = rng.integers(0, len(corpus) - T - 1, size=B)
            w = torch.from_numpy(corpus[offs[:, None] + np.arange(T + 1)])
            return w[:, :-1], w[:, 1:]

        def step(x, y):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        times = {"chat": 0.0, "lm": 0.0}
        positions = {"chat": 0, "lm": 0}
        learned = 0
        k = 0
        for r in range(rounds + 1):  # round 0 warms up and is not counted
            shapes = []
            t0 = time.perf_counter()
            for _ in range(steps):
                x, y = chat(k)
                k += 1
                step(x, y)
                shapes.append(tuple(x.shape))
                learned += int((y >= 0).sum()) if r else 0
            t1 = time.perf_counter()
            for shape in shapes:
                step(*lm(shape))
            t2 = time.perf_counter()
            if r:
                times["chat"] += t1 - t0
                times["lm"] += t2 - t1
                n = sum(b * t for b, t in shapes)
                positions["chat"] += n
                positions["lm"] += n
    pps = {k: positions[k] / times[k] for k in times}
    return {"chat_positions_per_s": pps["chat"], "lm_positions_per_s": pps["lm"],
            "chat_vs_lm": pps["chat"] / pps["lm"] - 1, "learned_fraction": learned / positions["chat"],
            "rounds": rounds, "steps_per_round": steps, "batch_size": batch_size, "threads": 1}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    lo = sub.add_parser("loss", help="assistant-token loss: fine-tuned with its template vs base with the transcript")
    lo.add_argument("--base", required=True)
    lo.add_argument("--tuned", required=True)
    lo.add_argument("--val", required=True)
    th = sub.add_parser("throughput", help="chat vs language-model training steps, interleaved, one thread")
    th.add_argument("--checkpoint", required=True)
    th.add_argument("--train", required=True)
    th.add_argument("--text", required=True)
    th.add_argument("--rounds", type=int, default=4)
    th.add_argument("--steps", type=int, default=10)
    th.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    try:
        if args.cmd == "loss":
            res = compare_loss(args.base, args.tuned, args.val)
        else:
            res = throughput(args.checkpoint, args.train, args.text, args.rounds, args.steps, args.batch_size)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v) for k, v in res.items()},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
