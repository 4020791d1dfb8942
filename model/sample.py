"""Sample from a checkpoint on the command line, streaming tokens as they arrive.

    python -m model.sample --checkpoint DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
                           [--top-k K] [--top-p P] [--seed S] [--interactive]

Prints only the continuation on stdout (the prompt is not echoed); `--interactive`
opens a `You:` / `Model:` chat loop over one growing transcript.
"""

from __future__ import annotations

import argparse
import sys

from model.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from model.device import resolve_device, resolve_dtype
from model.generate import stream_generate
from model.kv_cache import ContextLengthError
from model.sampling import SamplingParams


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m model.sample", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="checkpoint directory")
    ap.add_argument("--prompt", default=None, help="text to continue (default: <|endoftext|>, i.e. from scratch)")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    ap.add_argument("--seed", type=int, default=None, help="fixes the random stream (same seed → same text)")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not printed")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16")
    ap.add_argument("--interactive", action="store_true", help="chat loop: You: / Model:")
    return ap.parse_args(argv)


def stream_text(ck: Checkpoint, prompt_ids: list[int], params: SamplingParams) -> str:
    """Generate and print the continuation as it arrives; return it."""
    out = []
    for _, ev in stream_generate(ck.model, ck.tokenizer, [prompt_ids], params):
        if ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            out.append(ev.text)
    return "".join(out)


def chat(ck: Checkpoint, params: SamplingParams) -> None:
    """Keep one transcript; each turn appends `You: ...` and lets the model write the `Model:` line."""
    params.stop = list(params.stop) + ["\nYou:"]
    transcript = ""
    room = ck.config.block_size - params.max_new_tokens
    while True:
        try:
            line = input("You: ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line.strip() in ("exit", "quit"):
            return
        transcript += f"You: {line}\nModel:"
        ids = ck.tokenizer.encode(transcript)[-room:]  # forget the oldest turns when the context fills
        sys.stdout.write("Model:")
        reply = stream_text(ck, ids, params)
        transcript += reply + "\n"
        print()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                            stop=args.stop)
    try:
        params.validate()
        device = resolve_device(args.device)
        ck = load_checkpoint(args.checkpoint, device, resolve_dtype(args.dtype, device))
        if args.interactive:
            if params.max_new_tokens >= ck.config.block_size:
                raise ContextLengthError(f"max_new_tokens must be below the context length {ck.config.block_size}")
            chat(ck, params)
            return 0
        ids = ck.tokenizer.encode(args.prompt) if args.prompt else [ck.tokenizer.eot_id]
        stream_text(ck, ids, params)
        print()
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
