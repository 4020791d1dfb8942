"""Start-up to a healthy server, and idle memory: ours against llama-server on the same weights, interleaved.

    python -m bench.startup                     # GPT-2 124M (random, bench/common.py) and the bundled model
    python -m bench.startup --base ../base      # also ours from another checkout (a before/after)
    python -m bench.startup --models gpt2 --formats fp32,int8   # --quantize int8 against llama-server's q8_0

Each round starts every server in turn (the order reversed on odd rounds) with the settings users run: ours
`python -m app --device cpu --dtype fp32` (its own thread choice, its default slots: 32 on a CPU), llama-server
`-t <threads>` with 32 slots of the model's full context (bench/peers.py's command). Seconds from the process start to
/health answering 200 and /v1/models listing the model (bench.harness.Server), then the process tree's PSS after 2 s
idle. The GGUF files come from `python -m bench.peers --setup-only` (bench/peer_setup.py). JSON: bench/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import env_info, median, random_gpt2, write_result
from bench.harness import Server, compile_bytecode, free_port, tree_memory_mb
from bench.peers import CONTEXT, MODEL_NAME, SLOTS, parse_list

REPO = Path(__file__).resolve().parent.parent
PEERS = Path.home() / ".cache" / "gpt-serve-bench" / "peers"
MODELS = {"gpt2": ("gpt2-random-s0", None),
          "shakespeare": ("shakespeare-ours", REPO / "checkpoints" / "shakespeare")}
# ours `--quantize` → llama-server's GGUF of the same weights in the format llama.cpp users pick for it
FORMATS = {"fp32": ("none", "f32"), "int8": ("int8", "q8_0"), "int4": ("int4", "q4_0")}


def servers(model: str, fmt: str, checkpoint: Path, args, logdir: Path) -> dict[str, Server]:
    out: dict[str, Server] = {}
    quantize, gguf_type = FORMATS[fmt]
    trees = {"ours": REPO} | ({"ours-base": Path(args.base).resolve()} if args.base else {})
    for name, tree in trees.items():
        port = free_port()
        out[name] = Server(name, ["env", "-C", str(tree), sys.executable, "-m", "app", "--checkpoint", str(checkpoint),
                                  "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "fp32",
                                  "--quantize", quantize, "--model-name", MODEL_NAME, "--log-level", "warning"],
                           {}, logdir / f"{model}-{fmt}-{name}.log", port, wait_compile=False)
    gguf = Path(args.peers_dir) / "models" / f"{MODELS[model][0]}-{gguf_type}.gguf"
    llama = Path(args.peers_dir) / "llama-build" / "bin" / "llama-server"
    if gguf.is_file() and llama.is_file():
        port = free_port()
        ctx = min(CONTEXT, json.loads((checkpoint / "config.json").read_text())["block_size"])
        peer = f"llama-{gguf_type}"
        out[peer] = Server(peer, [str(llama), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                  "-t", str(args.threads), "-tb", str(args.threads), "-c", str(ctx * SLOTS),
                                  "-np", str(SLOTS), "--alias", MODEL_NAME, "--no-webui"],
                           {}, logdir / f"{model}-{fmt}-llama.log", port)
    else:
        print(f"  no llama-server or {gguf.name}: run `python -m bench.peers --setup-only` first", file=sys.stderr)
    return out


def one(server: Server) -> dict[str, Any]:
    server.start()
    try:
        rec: dict[str, Any] = {"startup_s": round(server.wait_ready(300), 2)}
        time.sleep(2)
        rec["idle_pss_mb"] = tree_memory_mb(server.proc.pid)["pss_mb"]
        return rec
    except Exception as e:  # noqa: BLE001 - a failed start is recorded; the other servers run
        return {"error": f"{type(e).__name__}: {e}"[-400:]}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,shakespeare", help="comma-separated subset of gpt2, shakespeare")
    ap.add_argument("--formats", default="fp32", help=f"comma-separated subset of {list(FORMATS)} (ours --quantize; "
                    "llama-server's GGUF: f32, q8_0, q4_0)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    ap.add_argument("--base", default=None, help="another checkout of this repository: its server too, as ours-base")
    ap.add_argument("--peers-dir", default=str(PEERS))
    ap.add_argument("--out", default="startup")
    args = ap.parse_args(argv)
    logdir = Path(args.peers_dir) / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"env": env_info(), "args": vars(args), "models": {}}
    runs_of = [(m, f) for m in parse_list(args.models, MODELS, "models") for f in parse_list(args.formats, FORMATS,
                                                                                            "formats")]
    for tree in [REPO] + ([Path(args.base).resolve()] if args.base else []):
        compile_bytecode(tree)  # each checkout's start timed as installed
    for model, fmt in runs_of:
        key = model if fmt == "fp32" else f"{model}-{fmt}"
        checkpoint = MODELS[model][1] or random_gpt2()[1]
        srv = servers(model, fmt, checkpoint, args, logdir)
        runs: dict[str, list] = {name: [] for name in srv}
        for r in range(args.rounds):
            order = list(srv) if r % 2 == 0 else list(srv)[::-1]
            for name in order:
                rec = one(srv[name])
                runs[name].append(rec)
                print(f"  {key} round {r + 1} {name:10s} {rec}", flush=True)
        summary = {}
        for name, recs in runs.items():
            ok = [x for x in recs if "error" not in x]
            summary[name] = {"startup_s": median([x["startup_s"] for x in ok]) if ok else None,
                             "startup_range": [min(x["startup_s"] for x in ok), max(x["startup_s"] for x in ok)]
                             if ok else None,
                             "idle_pss_mb": median([x["idle_pss_mb"] for x in ok]) if ok else None}
        peer = f"llama-{FORMATS[fmt][1]}"
        if summary.get(peer, {}).get("startup_s") and summary["ours"]["startup_s"]:
            ratio = summary["ours"]["startup_s"] / summary[peer]["startup_s"]
            summary["ours_over_llama_startup"] = round(ratio, 2)
        results["models"][key] = {"runs": runs, "summary": summary}
        print(json.dumps({key: summary}), flush=True)
    write_result(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
