"""Does a checkpoint continue a passage it was just shown (an induction head's job)? Passages of held-out text:
each passage (64 tokens), a newline, then its first 8 tokens again; 32 greedy tokens; how many equal the
passage's own next 32 tokens. A model that copies scores near 1; one that does not, near its plain next-token
accuracy. This decides what prompt-lookup speculation can gain on the model.

    python -m bench.induction --checkpoints /tmp/old checkpoints/shakespeare --text data/tinyshakespeare_val.txt
"""

from __future__ import annotations

import argparse

from bench.common import env_info, write_result


def score(path: str, text: str, passages: int, shown: int, cue: int, new: int) -> dict:
    import torch

    from model.checkpoint import load_checkpoint

    ck = load_checkpoint(path)
    tok, model = ck.tokenizer, ck.model.eval()
    ids, nl = tok.encode(text), tok.encode("\n")
    step = max(shown, (len(ids) - shown) // passages)
    hits = whole = 0
    for i in range(passages):
        p = ids[i * step: i * step + shown]
        idx = torch.tensor([p + nl + p[:cue]])
        out = []
        with torch.no_grad():
            for _ in range(new):
                t = int(model(idx)[0][0, -1].argmax())
                out.append(t)
                idx = torch.cat([idx, torch.tensor([[t]])], 1)
        h = sum(a == b for a, b in zip(out, p[cue:cue + new]))
        hits, whole = hits + h, whole + (h == new)
    return {"copied": round(hits / (passages * new), 4), "whole_passages": whole, "passages": passages}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoints", nargs="+", required=True)
    p.add_argument("--text", required=True, help="held-out text the passages are taken from")
    p.add_argument("--passages", type=int, default=40)
    p.add_argument("--out", default="induction")
    args = p.parse_args(argv)
    text = open(args.text, encoding="utf-8").read()
    res = {c: score(c, text, args.passages, 64, 8, 32) for c in args.checkpoints}
    for c, r in res.items():
        print(f"{c}: {r['copied']:.3f} of the shown passage's next 32 tokens copied; all 32 in "
              f"{r['whole_passages']}/{r['passages']}")
    print(f"wrote {write_result(args.out, {'env': env_info(), 'text': args.text, 'results': res})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
