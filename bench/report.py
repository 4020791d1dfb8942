"""Markdown tables of the latest results, for bench/README.md.

    python -m bench.report [decode] [serve] [train]     # names of bench/results/<name>.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

from bench.common import RESULTS


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _head(d: dict[str, Any]) -> str:
    git = d.get("git", {})
    commit = (git.get("commit") or "?")[:10] + (" + uncommitted model/ changes" if git.get("dirty") else "")
    probe = d.get("contention_probe") or {}
    sched = (d.get("scheduling") or {}).get("policy")
    return (f"{d['timestamp']}, commit {commit}, torch {d['torch']}, {d.get('threads')} thread(s), "
            f"{d['machine']['cpu']} ({d['machine']['cores']} cores), load average "
            f"{d['loadavg_start'][0]} → {d['loadavg_end'][0]}, contention probe {probe.get('slowdown')}"
            f"{', ' + sched if sched and sched != 'SCHED_OTHER' else ''}; `{d.get('command')}`")


def decode(name: str = "decode") -> str:
    d = _load(name)
    if d is None:
        return ""
    bw = d["memory_bandwidth"]
    lines = [f"**{name}** — {_head(d)}", "",
             f"Read bandwidth {bw['read_gbps']} GB/s (copy {bw['copy_gbps']} GB/s read+write) ÷ "
             f"{d['weight_bytes_per_step'] / 1e6:.1f} MB/step → batch-1 roofline {d['roofline_batch1_tok_s']} tok/s.",
             "",
             "| workload | TTFT ours | TTFT HF | ours/HF | decode ours | decode HF | ours/HF | total ours | total HF "
             "| ours/HF | roofline | ours % | HF % | = HF tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, w in d["workloads"].items():
        o, h, m = w["ours"], w["hf"], w["tokens_match_hf"]
        lines.append(
            f"| {k} (B={w['batch']}, prompt {w['prompt']}) | {o['ttft_ms']} ms | {h['ttft_ms']} ms | "
            f"**{w['ratio_ttft']}** | {o['decode_tok_s']} tok/s | {h['decode_tok_s']} tok/s | "
            f"**{w['ratio_decode']}** | "
            f"{o['total_tok_s']} | {h['total_tok_s']} | {w['ratio_total']} | {w['roofline_tok_s']} tok/s | "
            f"{w['ours_roofline_fraction']:.0%} | {w['hf_roofline_fraction']:.0%} | "
            f"{'yes' if m['equal'] else str(m['matching_tokens']) + '/' + str(m['tokens'])} |")
    return "\n".join(lines)


def serve(name: str = "serve") -> str:
    d = _load(name)
    if d is None:
        return ""
    workloads = ", ".join(d.get("workloads") or ["greedy"])  # results before the sampled workloads: greedy only
    if d.get("sampled_workloads_on") and workloads != "greedy":
        workloads += f" (non-greedy on the `{d['sampled_workloads_on']}` server)"
    batch = ", ".join(f"{k} {v}" for k, v in (d.get("max_batch_size") or {}).items())
    library = d["summary"].get("library_batch1_tok_s")
    lines = [f"**{name}** — {_head(d)}", "",
             f"Prompt {d['prompt_tokens']} tokens, {d['max_new_tokens']} new tokens, {workloads}, "
             f"{d['requests_per_stream']} requests per stream and level"
             + (f"; GPT_MAX_BATCH_SIZE {batch}" if batch else "")
             + (f". Library loop, batch 1: {library} tok/s" if library else "")
             + f". HF offline batch 8: {(d.get('hf_offline_batch8') or {}).get('tok_s')} tok/s. "
             f"Summary: `{json.dumps(d['summary'])}`", "",
             "| server | streams | requests | tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | errors | load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for server, rows in d["levels"].items():
        for r in rows:
            lines.append(f"| {server} | {r['streams']} | {r['requests']} | {r['tok_s']} | {r['ttft_ms_p50']} ms | "
                         f"{r['ttft_ms_p99']} ms | {r['itl_ms_p50']} ms | {r['itl_ms_p99']} ms | {r['errors']} | "
                         f"{r.get('loadavg')} |")
    return "\n".join(lines)


def train(name: str = "train") -> str:
    d = _load(name)
    if d is None:
        return ""
    r = d["results"]
    c = d["config"]
    return "\n".join([
        f"**{name}** — {_head(d)}", "",
        f"{c['layers']} layers, {c['dims']} dims, {c['heads']} heads, context {c['block']}, vocab {c['vocab']}, "
        f"batch {c['batch']}; {d['rounds']} rounds × {d['steps_per_round']} steps.", "",
        "| model | step | tokens/s |", "|---|---|---|",
        f"| ours | {r['ours']['step_ms']} ms | {r['ours']['tok_s']} |",
        f"| HF | {r['hf']['step_ms']} ms | {r['hf']['tok_s']} |",
        f"| **ours / HF** | | **{d['ratio']}** (per-round median {d['ratio_per_round_median']}) |"])


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or ["decode", "serve", "train"]
    for n in names:
        kind = n.split("-")[0]
        out = {"decode": decode, "serve": serve, "train": train}[kind](n)
        if out:
            print(out, end="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
