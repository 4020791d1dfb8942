"""Tool calling with `tool_choice: auto`: how often a served model calls the right function with the right arguments
on held-out prompts, and answers in text where no call is wanted (the tool-calling fine-tune of docs/training.md).

    python -m bench.tool_calls --url http://127.0.0.1:8000 --val /tmp/shtools/val.jsonl [--limit 300]
                               [--out tool-calls]

Each line of --val (OpenAI's fine-tuning format with `tools`, as training/shakespeare/tools.py writes) gives a
prompt (the messages before the first assistant message) and what that message is: a call (function and
arguments) or text. The prompt goes to the server's /v1/chat/completions with the line's tools, tool_choice auto,
greedy, through the unmodified openai SDK; the reply's `tool_calls` are what the server's parser found.
Reported: for call prompts, the share that wrote a `<tool_call>` tag (parsed or not: the JSON may be malformed), with
a parsed call, with the expected function, and with exactly the expected arguments; for text prompts, the share
answered without a call. Writes bench/results/<out>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def cases(path: Path, limit: int) -> list[tuple[list[dict], list[dict], dict | None]]:
    """(prompt messages, tools, the expected call or None for text) of each line."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines()[:limit]:
        row = json.loads(line)
        msgs = row["messages"]
        first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        calls = msgs[first].get("tool_calls")
        expected = None
        if calls:
            f = calls[0]["function"]
            expected = {"name": f["name"], "arguments": json.loads(f["arguments"])}
        out.append((msgs[:first], row["tools"], expected))
    return out


def run(url: str, val: Path, limit: int, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=120)
    counts = {"call_prompts": 0, "tagged_call": 0, "parsed_call": 0, "right_function": 0, "exact_arguments": 0,
              "text_prompts": 0, "no_call": 0}
    examples = []
    t0 = time.monotonic()
    for messages, tools, expected in cases(val, limit):
        r = client.chat.completions.create(model="m", messages=messages, tools=tools, temperature=0,
                                           max_tokens=max_tokens)
        calls = r.choices[0].message.tool_calls or []
        got = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in calls]
        if expected is None:
            counts["text_prompts"] += 1
            counts["no_call"] += not got
        else:
            counts["call_prompts"] += 1
            counts["tagged_call"] += bool(got) or "<tool_call>" in (r.choices[0].message.content or "")
            counts["parsed_call"] += bool(got)
            counts["right_function"] += bool(got) and got[0]["name"] == expected["name"]
            counts["exact_arguments"] += bool(got) and got[0] == expected
        if len(examples) < 12:
            examples.append({"prompt": messages[-1]["content"], "expected": expected, "calls": got,
                             "content": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason})
    calls_n, text_n = max(1, counts["call_prompts"]), max(1, counts["text_prompts"])
    rates = {"tagged_call_rate": counts["tagged_call"] / calls_n, "parsed_call_rate": counts["parsed_call"] / calls_n,
             "right_function_rate": counts["right_function"] / calls_n,
             "exact_arguments_rate": counts["exact_arguments"] / calls_n,
             "no_call_rate_on_text_prompts": counts["no_call"] / text_n}
    return {"val": str(val), "url": url, "max_tokens": max_tokens, "counts": counts, "rates": rates,
            "seconds": round(time.monotonic() - t0, 1), "examples": examples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tool_calls", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--val", required=True, type=Path, help="held-out JSONL with tools (training/shakespeare/tools.py)")
    p.add_argument("--limit", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=60)
    p.add_argument("--out", default="tool-calls", help="bench/results/<out>.json")
    args = p.parse_args(argv)
    if not args.val.is_file():
        print(f"python -m bench.tool_calls: error: {args.val}: no such file", file=sys.stderr)
        return 2
    result = run(args.url, args.val, args.limit, args.max_tokens)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({"counts": result["counts"], "rates": result["rates"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
