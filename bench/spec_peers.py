"""Speculative decoding beside llama-server's: batch-1 greedy decode tok/s over HTTP streaming, same weights, prompts.

    python -m bench.spec_peers [--rounds 3] [--threads 2] [--servers ours-off,ours-ngram,llama-off,llama-ngram]

The model is the copy model of bench/spec_models.py (~/.cache/gpt-serve-bench/spec-copy: the bundled model
fine-tuned to repeat a passage; its own 2048-token BPE tokenizer), exported to GGUF f32 with our exporter
(`python -m model.export_gguf --type f32`, which carries our tokenizer) for llama-server; our server loads the
checkpoint with `--dtype fp32` (its default `auto` may pick bf16 on this CPU), so both sides compute in f32. The
prompts are bench/speculative.py's copy workload (a held-out tinyshakespeare passage and "\\n\\nAgain:\\n"; 8
requests, as many new tokens as the passage), sent as token ids so both servers see identical prompts, greedy
(temperature 0, `ignore_eos`), one request at a time.

Servers (bench/peers.py's server_command and stream_request, bench/harness.py's Server):
- ours-off / ours-ngram / ours-ngram-k15: `python -m app --dtype fp32` with `--speculative off` / `ngram` (its
  defaults: k 8, n-grams 3-4) / ngram with `--num-speculative-tokens 15` (the most one request gets per pass),
  `--torch-threads THREADS`, default slots and the default `--compile auto` (the decode step compiled in the background
  for a model this small; the bench waits for it); ours-eager / ours-ngram-eager: the same with `--compile off`.
- llama-off / llama-ngram / llama-ngram-defaults: llama-server on the GGUF, `-t THREADS -tb THREADS -np 1 -c 256`,
  `--spec-type none` / `ngram-simple` with `--spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8
  --spec-ngram-simple-min-hits 1` (lookup 3-gram, 8-token drafts: as ours) / ngram-simple with llama.cpp's
  defaults (size-n 12, size-m 48, min-hits 1).

Each round starts every server in turn (order reversed on odd rounds), warms it with one request, streams the 8
requests and stops it. Decode tok/s = tokens after each request's first ÷ time after its first, summed over the
requests (as bench/speculative.py); token counts from the stream's usage chunk. Round 1 also fetches every
server's greedy token ids untimed (llama-server /completion with return_tokens; ours /generate with details, given
the prompt's text where it encodes back to the same ids) and reports the fraction of prompts whose outputs are
identical to ours-off. Writes bench/results/spec-peers.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import CACHE, REPO, env_info, median, print_table, set_threads, write_result
from bench.harness import Server, free_port, proc_cpu_s, proc_tree
from bench.peer_setup import llama_binary, run_logged
from bench.peers import (
    MODEL_NAME,
    completion_body,
    first_mismatch,
    greedy_ids,
    lscpu_info,
    server_command,
    stream_request,
)

CONTEXT = 256  # the copy model's block size
QUIET = 0.05  # a round counts as quiet when the rest of the machine used at most this share of the cores
LLAMA_NGRAM = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8",
               "--spec-ngram-simple-min-hits", "1"]
LLAMA_NGRAM_DEFAULTS = ["--spec-type", "ngram-simple"]
# name → kind (as bench/peers.SERVERS), speculation (ours: GPT_SPECULATIVE; llama: extra arguments)
SERVERS: dict[str, dict[str, Any]] = {
    "ours-off": {"kind": "ours", "speculative": "off"},
    "ours-ngram": {"kind": "ours", "speculative": "ngram"},
    # 15 proposed tokens: the most one request gets (engine/spec_decode/config.py VERIFY_POSITIONS 16 per pass)
    "ours-ngram-k15": {"kind": "ours", "speculative": "ngram", "args": ["--num-speculative-tokens", "15"]},
    # threads left to the server (engine.cpu_tuning.choose_threads: both of two cores where the step is compiled)
    "ours-off-auto": {"kind": "ours", "speculative": "off", "default_threads": True},
    # the decode step left eager (GPT_COMPILE=off; the others use the default, auto: compiled for a model this small,
    # engine/compiled_decode.py, waited for by bench/harness.Server.wait_ready)
    "ours-eager": {"kind": "ours", "speculative": "off", "args": ["--compile", "off"]},
    "ours-ngram-eager": {"kind": "ours", "speculative": "ngram", "args": ["--compile", "off"]},
    "ours-ngram-auto": {"kind": "ours", "speculative": "ngram", "default_threads": True},
    # what `python -m app --checkpoint DIR` serves: every setting at its default (--dtype auto, threads, compile)
    "ours-default": {"kind": "ours", "speculative": "off", "default_threads": True, "default_dtype": True},
    # bf16 weights (until session 33, --dtype auto's pick for the bundled model on avx512_bf16 hosts), eager
    "ours-bf16": {"kind": "ours", "speculative": "off", "args": ["--dtype", "bf16"]},
    "llama-off": {"kind": "llama", "args": ["--spec-type", "none"]},
    "llama-ngram": {"kind": "llama", "args": LLAMA_NGRAM},
    "llama-ngram-defaults": {"kind": "llama", "args": LLAMA_NGRAM_DEFAULTS},
}
DEFAULT_SERVERS = ",".join(SERVERS)
# the goal's pair: ours with speculation vs llama-server with its speculation (the better of its configurations)
OURS_SPEC, LLAMA_SPECS = "ours-ngram", ("llama-ngram", "llama-ngram-defaults")
OFF_OF = {"ours-ngram": "ours-off", "ours-ngram-k15": "ours-off", "ours-ngram-auto": "ours-off-auto",
          "ours-ngram-eager": "ours-eager",
          "llama-ngram": "llama-off",
          "llama-ngram-defaults": "llama-off"}


# ---------------------------------------------------------------- pure helpers (tests/test_bench_spec_peers.py)

def set_arg(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag`'s value replaced (or `flag value` appended when absent)."""
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def drop_arg(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and its value."""
    if flag not in argv:
        return list(argv)
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


def decode_rate(reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """Batch-1 decode numbers of stream_request records: tokens after each request's first ÷ time after its first,
    summed over the requests; end-to-end tok/s (all tokens ÷ time from send to the last token, summed); TTFT median
    (ms); tokens counted from usage where sent, else events."""
    ok = [r for r in reqs if r["error"] is None and r["times"]]
    tokens = [r["completion_tokens"] if r["completion_tokens"] is not None else len(r["times"]) for r in ok]
    span = sum(r["times"][-1] - r["times"][0] for r in ok)
    after_first = sum(n - 1 for n in tokens)
    return {"requests": len(reqs), "errors": len(reqs) - len(ok),
            "error_examples": sorted({str(r["error"]) for r in reqs if r["error"]})[:3],
            "generated_tokens": sum(tokens),
            "decode_tok_s": round(after_first / span, 2) if span > 0 else None,
            "e2e_tok_s": round(sum(tokens) / sum(r["times"][-1] for r in ok), 2) if ok else None,
            "ttft_ms_p50": round(1000 * median([r["times"][0] for r in ok]), 2) if ok else None,
            "events_per_token": round(sum(len(r["times"]) for r in ok) / sum(tokens), 3) if sum(tokens) else None}


def agreement(ids: dict[str, list[list[int] | None]], ref: str) -> dict[str, Any]:
    """Per server: how many prompts' greedy ids equal `ref`'s (prompts either lacks are not compared)."""
    out: dict[str, Any] = {}
    for name, outs in ids.items():
        if name == ref or ref not in ids:
            continue
        pairs = [(a, b) for a, b in zip(ids[ref], outs) if a is not None and b is not None]
        same = sum(a == b for a, b in pairs)
        out[name] = {"identical": same, "compared": len(pairs),
                     "fraction": round(same / len(pairs), 3) if pairs else None,
                     # per differing prompt: (its index, the first differing position, the tokens compared there)
                     "first_mismatch": [(i, p, len(a)) for i, (a, b) in enumerate(zip(ids[ref], outs))
                                        if a is not None and b is not None and (p := first_mismatch(a, b)) is not None]}
    return out


def summarize(rounds: dict[str, list[dict[str, Any]]], max_other_cpu: float | None = None) -> dict[str, Any]:
    """Median decode tok/s (and range) per server over its rounds; each speculating server's ratio to its own
    speculation off (per round, then the median: same-round pairs), and ours-ngram ÷ each llama speculation and
    ÷ the better of them. With max_other_cpu: only the server rounds during which the rest of the machine used at
    most that share of the cores."""
    if max_other_cpu is not None:
        rounds = {n: [r for r in rs if (r.get("other_cpu_share") or 0) <= max_other_cpu] for n, rs in rounds.items()}
    out: dict[str, Any] = {"servers": {}, "ratios": {}}
    for name, rs in rounds.items():
        vals = [r["decode_tok_s"] for r in rs if r.get("decode_tok_s")]
        ttft = [r["ttft_ms_p50"] for r in rs if r.get("ttft_ms_p50") is not None]
        e2e = [r["e2e_tok_s"] for r in rs if r.get("e2e_tok_s")]
        if vals:
            out["servers"][name] = {"decode_tok_s": round(median(vals), 2), "range": [min(vals), max(vals)],
                                    "rounds": len(vals), "ttft_ms_p50": round(median(ttft), 2) if ttft else None,
                                    "e2e_tok_s": round(median(e2e), 2) if e2e else None}

    def paired(a: str, b: str) -> float | None:
        ra = {r["round"]: r.get("decode_tok_s") for r in rounds.get(a, [])}
        rb = {r["round"]: r.get("decode_tok_s") for r in rounds.get(b, [])}
        xs = [ra[k] / rb[k] for k in ra if ra[k] and rb.get(k)]
        return round(median(xs), 3) if xs else None

    for spec, off in OFF_OF.items():
        if (r := paired(spec, off)) is not None:
            out["ratios"][f"{spec} / {off}"] = r
    best = None
    for peer in LLAMA_SPECS:
        if (r := paired(OURS_SPEC, peer)) is not None:
            out["ratios"][f"{OURS_SPEC} / {peer}"] = r
            best = r if best is None else min(best, r)
        for ours in ("ours-ngram-k15", "ours-ngram-auto"):
            if (r := paired(ours, peer)) is not None:
                out["ratios"][f"{ours} / {peer}"] = r
    for ours in ("ours-off", "ours-off-auto", "ours-default", "ours-bf16"):
        if (r := paired(ours, "llama-off")) is not None:
            out["ratios"][f"{ours} / llama-off"] = r
    for a, b in (("ours-off-auto", "ours-off"), ("ours-default", "ours-bf16")):
        if (r := paired(a, b)) is not None:
            out["ratios"][f"{a} / {b}"] = r
    if best is not None:
        out["goal"] = {"what": "copy-heavy batch-1 greedy decode, ours with speculation >= 1.0x llama-server with "
                               "its speculation (the better of its configurations), same run",
                       "ratio": best, "target": 1.0, "met": best >= 1.0}
    return out


# ---------------------------------------------------------------- setup and the run

def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (/proc/stat: all but idle and iowait)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used by pid's process tree (alive members) and by this process."""
    return sum(os.times()[:2]) + sum(s for p in proc_tree(pid) if (s := proc_cpu_s(p)) is not None)


def export_gguf(checkpoint: Path, peers: Path) -> Path:
    """Our exporter's f32 GGUF of the checkpoint in peers/models (redone when the checkpoint is newer)."""
    out = peers / "models" / f"{checkpoint.name}-ours-f32.gguf"
    src = checkpoint / "model.safetensors"
    if not (out.is_file() and out.stat().st_mtime >= src.stat().st_mtime):
        out.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        run_logged([sys.executable, "-m", "model.export_gguf", "--checkpoint", str(checkpoint), "--out", str(out),
                    "--type", "f32"], peers / "logs" / "export-gguf-spec.log", 600, cwd=REPO, env=env)
    return out


def command(name: str, port: int, threads: int, checkpoint: Path, gguf: Path, llama: Path) -> tuple[list[str],
                                                                                                  dict[str, str]]:
    """bench/peers.server_command's argv for `ours` / `llama-f32`, with this bench's slots, context and speculation."""
    spec = SERVERS[name]
    paths = {"python": sys.executable, "checkpoint": checkpoint, "llama_server": llama, "gguf": {"f32": gguf},
             "ours_default_slots": True}
    if spec["kind"] == "ours":
        argv, env = server_command("ours", port, threads, paths)
        if spec.get("default_threads"):
            argv = drop_arg(argv, "--torch-threads")
        if spec.get("default_dtype"):
            argv = drop_arg(argv, "--dtype")
        return [*argv, "--speculative", spec["speculative"], *spec.get("args", [])], env
    argv, env = server_command("llama-f32", port, threads, paths)
    argv = set_arg(set_arg(argv, "-c", str(CONTEXT)), "-np", "1")
    return [*argv, *spec["args"]], env


def copy_prompts() -> list[tuple[list[int], int]]:
    """bench/speculative.py's copy workload: (prompt ids, new tokens) per request."""
    from bench.spec_models import COPY_DIR
    from bench.speculative import workloads

    return [(p, params.max_new_tokens) for p, params in workloads(False, COPY_DIR, None)["copy"]["requests"]]


async def drive(port: int, prompts: list[tuple[list[int], int]], timeout: float) -> list[dict[str, Any]]:
    out = []
    for prompt, n in prompts:
        body = {**completion_body(prompt, n, 0.0, None), "ignore_eos": True}
        out.append(await stream_request("127.0.0.1", port, body, timeout))
    return out


def fetch_ids(kind: str, url: str, prompts: list[tuple[list[int], int]], tok, timeout: float) -> list[list[int] | None]:
    """Greedy ids of every prompt (up to its max_tokens or <|endoftext|>, which is dropped) through
    bench/peers.greedy_ids: llama-server's /completion takes the ids; ours' /generate takes text, so a prompt whose
    text does not encode back to its ids gets None (not compared)."""
    out: list[list[int] | None] = []
    for prompt, n in prompts:
        text = tok.decode(prompt)
        if kind == "ours" and tok.encode(text) != prompt:
            out.append(None)
            continue
        got = greedy_ids(kind, url, prompt, text, n, timeout)
        out.append(got[:got.index(tok.eot_id)] if tok.eot_id in got else got)
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.spec_models import COPY_DIR

    ap = argparse.ArgumentParser(prog="python -m bench.spec_peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", default=DEFAULT_SERVERS, help=f"comma-separated subset of {list(SERVERS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="threads of every server (llama -t/-tb, ours "
                                                           "--torch-threads)")
    ap.add_argument("--checkpoint", type=Path, default=COPY_DIR)
    ap.add_argument("--peers-dir", type=Path, default=CACHE / "peers")
    ap.add_argument("--requests", type=int, default=8, help="the first N of the copy workload's 8 prompts")
    ap.add_argument("--no-agreement", action="store_true", help="skip the untimed greedy-id comparison")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--out", default="spec-peers")
    args = ap.parse_args(argv)
    names = [n for n in args.servers.split(",") if n]
    if unknown := [n for n in names if n not in SERVERS]:
        raise SystemExit(f"unknown servers {unknown}; choose from {list(SERVERS)}")
    threads = set_threads(args.threads)
    checkpoint = args.checkpoint.resolve()
    if not (checkpoint / "config.json").is_file():
        raise SystemExit(f"no copy model at {checkpoint}: python -m bench.spec_models")
    llama = llama_binary(args.peers_dir, "llama-server")
    if not llama.is_file():
        raise SystemExit(f"no llama-server at {llama}: python -m bench.peers --setup-only --servers llama-f32")
    t = time.monotonic()
    gguf = export_gguf(checkpoint, args.peers_dir)
    export_s = round(time.monotonic() - t, 1)
    prompts = copy_prompts()[:args.requests]
    from model.checkpoint import load_checkpoint

    tok = load_checkpoint(checkpoint).tokenizer
    info = env_info()
    logs = Path(tempfile.mkdtemp(prefix="bench-spec-peers-"))
    load_before = os.getloadavg()
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    commands: dict[str, Any] = {}
    ids: dict[str, list[list[int] | None]] = {}
    print(f"servers {names}, {args.rounds} rounds, {threads} threads, {len(prompts)} prompts "
          f"({sum(n for _, n in prompts)} new tokens); load {load_before}; logs in {logs}", flush=True)
    for rnd in range(args.rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            port = free_port()
            argv_, env = command(name, port, threads, checkpoint, gguf, llama)
            commands[name] = {"argv": argv_, "env": env}
            server = Server(name, argv_, env, logs / f"{name}.log", port)
            rec: dict[str, Any] = {"round": rnd + 1}
            server.start()
            try:
                rec["startup_s"] = round(server.wait_ready(args.timeout_s), 2)
                rec["compile_wait_s"] = server.compile_wait_s
                warm = asyncio.run(drive(port, prompts[:1], args.timeout_s))[0]
                if warm["error"]:
                    raise RuntimeError(f"warm-up request failed: {warm['error']}")
                t0, busy0, mine0 = time.monotonic(), busy_cpu_s(), tree_cpu_s(server.proc.pid)
                reqs = asyncio.run(drive(port, prompts, args.timeout_s))
                wall, busy, mine = time.monotonic() - t0, busy_cpu_s() - busy0, tree_cpu_s(server.proc.pid) - mine0
                rec.update(decode_rate(reqs))
                # CPU the rest of the machine used while the requests ran (other sessions' work): share of all cores
                rec["other_cpu_share"] = round(max(0.0, busy - mine) / (wall * (os.cpu_count() or 1)), 3)
                rec["loadavg"] = round(os.getloadavg()[0], 2)
                if rnd == 0 and not args.no_agreement:
                    try:
                        ids[name] = fetch_ids(SERVERS[name]["kind"], server.url, prompts, tok, args.timeout_s)
                    except Exception as e:  # noqa: BLE001 - reported, the timing stands
                        rec["ids_error"] = f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - a failed server round is recorded, the others run
                rec["error"] = f"{type(e).__name__}: {e}"
                print(f"  {name}: FAILED: {rec['error'][-500:]}", file=sys.stderr, flush=True)
            finally:
                server.stop()
            rounds[name].append(rec)
            print(f"  round {rnd + 1} {name:22s} decode {rec.get('decode_tok_s')} tok/s  TTFT p50 "
                  f"{rec.get('ttft_ms_p50')} ms  e2e {rec.get('e2e_tok_s')} tok/s  "
                  f"tokens {rec.get('generated_tokens')}  errors {rec.get('errors')}  "
                  f"load {rec.get('loadavg')}  other CPU {rec.get('other_cpu_share')}", flush=True)
    summ = summarize(rounds)
    quiet = summarize(rounds, QUIET)
    agree = agreement(ids, "ours-off")
    agree_llama = agreement({k: v for k, v in ids.items() if k.startswith("llama")}, "llama-off")
    rows = [[n, (summ["servers"].get(n) or {}).get("decode_tok_s"), (summ["servers"].get(n) or {}).get("range"),
             (summ["servers"].get(n) or {}).get("ttft_ms_p50"), (summ["servers"].get(n) or {}).get("e2e_tok_s"),
             "ref" if n == "ours-off" else (agree.get(n) or {}).get("fraction")] for n in names]
    print_table(["server", "decode tok/s", "range", "TTFT ms", "e2e tok/s", "greedy = ours-off"], rows)
    print(json.dumps(summ["ratios"]))
    print(f"rounds with other CPU <= {QUIET}: {json.dumps(quiet['ratios'])}")
    for label, sm in (("all rounds", summ), (f"other CPU <= {QUIET}", quiet)):
        if "goal" in sm:
            g = sm["goal"]
            print(f"goal ({label}): {g['what']}: {g['ratio']} ({'met' if g['met'] else 'not met'})")
    data = {**info, "benchmark": "spec-peers", "lscpu": lscpu_info(), "checkpoint": str(checkpoint),
            "gguf": str(gguf), "gguf_export": "python -m model.export_gguf --type f32", "export_s": export_s,
            "threads": threads, "context_llama": CONTEXT, "rounds": args.rounds, "model_name": MODEL_NAME,
            "prompts": [{"prompt_tokens": len(p), "max_tokens": n} for p, n in prompts],
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "servers": {n: {**SERVERS[n], **commands.get(n, {}), "rounds": rounds[n]} for n in names},
            "summary": summ, f"summary_other_cpu_at_most_{QUIET}": quiet, "greedy_agreement_with_ours_off": agree,
            "greedy_agreement_llama_with_llama_off": agree_llama,
            "ours_prompts_without_text_round_trip": sum(x is None for x in ids.get("ours-off", []))}
    print(f"wrote {write_result(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
