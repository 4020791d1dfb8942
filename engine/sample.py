"""Sample from a checkpoint on the command line, streaming tokens as they arrive.

    python -m engine.sample --checkpoint DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
                           [--top-k K] [--top-p P] [--seed S] [--num-samples N] [--interactive]
                           [--speculative ngram|draft:CHECKPOINT] [--num-speculative-tokens K]

Prints only the continuation on stdout (the prompt is not echoed); `--interactive`
opens a `You:` / `Model:` chat loop over one growing transcript. Ctrl-C during a reply
stops that reply and returns to the `You:` prompt; Ctrl-C or Ctrl-D at the prompt exits.
Piping into `head` and the like stops quietly once the reader has gone.
"""

from __future__ import annotations

import argparse
import os
import sys

from engine.generate import speculation, stream_generate
from engine.params import SamplingParams
from engine.request import check_context
from engine.spec_decode import parse_speculative
from engine.spec_decode.config import DEFAULT_K
from model.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from model.device import resolve_device, resolve_dtype

EXIT_SIGINT = 130  # 128 + SIGINT, as a shell reports a process killed by Ctrl-C
EXIT_SIGPIPE = 141  # 128 + SIGPIPE, as `yes | head` reports it


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except where there is none to show (required, or None)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine.sample", description=__doc__.split("\n\n")[0],
                                 formatter_class=_HelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="checkpoint directory")
    ap.add_argument("--prompt", default=None,
                    help="text to continue; without it, generation starts from <|endoftext|> (from scratch)")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per sample or reply")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1 = off")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="> 1 discourages tokens already seen; 1 = off")
    ap.add_argument("--seed", type=int, default=None,
                    help="fixes the random stream (same seed → same text); without it, a fresh random seed")
    ap.add_argument("--num-samples", type=int, default=1,
                    help="independent samples to print one after another, each ending in a newline "
                         "(with --seed S, sample i uses seed S+i)")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not printed")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--dtype", default="auto", help="auto | fp32 | bf16 | fp16")
    ap.add_argument("--interactive", action="store_true", help="chat loop: You: / Model:")
    ap.add_argument("--speculative", default="off",
                    help="off | ngram | draft:CHECKPOINT: speculative decoding (the same text, sooner where "
                         "proposals hold)")
    ap.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_K, help="most tokens proposed per step")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def stream_text(ck: Checkpoint, prompt_ids: list[int], params: SamplingParams, out: list[str] | None = None,
                spec: tuple = (None, None)) -> str:
    """Generate and print the continuation as it arrives; return it.

    Each piece is also appended to `out` as it is printed, so a caller interrupted mid-reply
    (KeyboardInterrupt) still knows what was shown. The generator is closed on the way out, so an
    interruption stops the generation itself, not only the printing.
    """
    out = [] if out is None else out
    events = stream_generate(ck.model, ck.tokenizer, [prompt_ids], params, speculative=spec[0], draft_model=spec[1])
    try:
        for _, ev in events:
            if ev.text:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
                out.append(ev.text)
    finally:
        events.close()
    return "".join(out)


def chat(ck: Checkpoint, params: SamplingParams, spec: tuple = (None, None)) -> None:
    """Keep one transcript; each turn appends `You: ...` and lets the model write the `Model:` line.

    Ctrl-C during a reply cuts it short (what was shown stays in the transcript) and asks again;
    Ctrl-C or Ctrl-D at the prompt, or `exit` / `quit`, ends the chat.
    """
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
        reply: list[str] = []
        try:
            stream_text(ck, ids, params, reply, spec)
        except KeyboardInterrupt:
            pass  # the reply stops here; the chat goes on
        transcript += "".join(reply) + "\n"
        print()


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                            stop=args.stop)
    try:
        params.validate()
        if args.num_samples < 1:
            raise ValueError(f"num_samples must be at least 1, got {args.num_samples}")
        device = resolve_device(args.device)
        ck = load_checkpoint(args.checkpoint, device, resolve_dtype(args.dtype, device))
        spec = speculation(ck.model, ck.tokenizer, parse_speculative(args.speculative, args.num_speculative_tokens))
        if args.interactive:
            check_context(1, params.max_new_tokens, ck.config.block_size)  # a turn of one token must fit
            chat(ck, params, spec)
            return 0
        ids = ck.tokenizer.encode(args.prompt) if args.prompt else [ck.tokenizer.eot_id]
        for i in range(args.num_samples):
            if args.seed is not None:
                params.seed = args.seed + i
            stream_text(ck, ids, params, spec=spec)
            print()
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except BrokenPipeError:
        # The reader has gone (`| head`): stop quietly. Point stdout at /dev/null, so that the
        # interpreter's own flush at exit has nowhere to fail and prints no "Exception ignored".
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_SIGPIPE
    except KeyboardInterrupt:
        # Ctrl-C outside a chat reply (loading, or a plain sample): stop without a traceback
        print(file=sys.stderr)
        return EXIT_SIGINT


if __name__ == "__main__":
    sys.exit(main())
