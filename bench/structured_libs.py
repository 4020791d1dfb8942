"""Grammar libraries on our own tokenizers: xgrammar vs llguidance (vs outlines-core when it is installed).

    python -m bench.structured_libs [--tokenizers shakespeare,r50k_base] [--repeats 3] [--out structured-libs]

Each library gets the tokenizer the server has (`model.tokenizer.Tokenizer`: tiktoken byte-level BPE, the
bundled model's 2,048-token ranks file and GPT-2's r50k_base), built from our objects, not from a Hugging Face
tokenizer. Reported per (library, tokenizer):
- `tokenizer_s`: building the library's view of the vocabulary (once per server);
- per schema (bench.structured.SCHEMAS): whether it compiles (the library's reason when not), compile time
  (cold: a fresh compiler, so no cache), and the per-token mask time: a valid document of the schema is
  tokenized, and at every token the matcher fills the 32-bit packed mask of the next token and accepts the
  token (median and p99 µs per fill, and µs per accept); `ok` says every token of the document was allowed;
- a regex, and a JSON object of any shape.

Writes bench/results/<out>.json and prints a table. Single-threaded, CPU only; a few seconds per library.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from bench.common import REPO, env_info, print_table, write_result

REGEX = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]) [A-Z][a-z]{2,12}"
REGEX_SAMPLE = "2024-07-14 Paris"


def load_tokenizer(name: str):
    from model.tokenizer import Tokenizer

    if name == "shakespeare":
        return Tokenizer.from_ranks_file(REPO / "checkpoints" / "shakespeare" / "shakespeare.tiktoken")
    return Tokenizer.named(name)


def timed_walk(fill, accept, mask, tokens: list[int], eos: int) -> tuple[list[float], list[float], bool]:
    """Walk a document's tokens and EOS through a matcher: fill() writes the next token's packed mask into mask
    (1, words), accept(t) takes t. Returns seconds per fill, per accept, and whether every token was allowed and
    accepted (the caller adds the library's own end-of-grammar check)."""
    fills, accepts, ok = [], [], True
    for t in [*tokens, eos]:
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        ok &= bool((mask[0, t // 32] >> (t % 32)) & 1)
        t2 = time.perf_counter()
        ok &= bool(accept(t))
        accepts.append(time.perf_counter() - t2)
        fills.append(t1 - t0)
    return fills, accepts, ok


# ---------------------------------------------------------------------------------------------- adapters
class XGrammar:
    name = "xgrammar"

    def __init__(self, tok) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                                      stop_token_ids=[tok.eot_id])
        self.vocab_size = tok.vocab_size

    def compile(self, kind: str, value: str):
        c = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json":
            return c.compile_json_schema(value, any_whitespace=True)
        return c.compile_regex(value)

    def walk(self, compiled, tokens: list[int], eos: int) -> tuple[list[float], list[float], bool]:
        m = self.xgr.GrammarMatcher(compiled)
        mask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        fills, accepts, ok = timed_walk(lambda: m.fill_next_token_bitmask(mask, 0), m.accept_token, mask, tokens, eos)
        return fills, accepts, ok and m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok) -> None:
        import llguidance
        import llguidance.tiktoken

        self.llg = llguidance
        self.tok = llguidance.tiktoken.lltokenizer_from_encoding(tok.encoding, n_vocab=tok.vocab_size,
                                                                  eos_token=tok.eot_id)
        self.vocab_size = tok.vocab_size

    def compile(self, kind: str, value: str):
        g = (self.llg.LLMatcher.grammar_from_json_schema(value, defaults={"whitespace_flexible": True})
             if kind == "json" else self.llg.grammar_from("regex", value))
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return g

    def walk(self, grammar, tokens: list[int], eos: int) -> tuple[list[float], list[float], bool]:
        import llguidance.torch as lt

        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        mask = lt.allocate_token_bitmask(1, self.vocab_size)
        fills, accepts, ok = timed_walk(lambda: lt.fill_next_token_bitmask(m, mask, 0), m.consume_token, mask,
                                        tokens, eos)
        return fills, accepts, ok and not m.is_error()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok) -> None:
        from outlines_core import Vocabulary

        vocab: dict[bytes, list[int]] = {}
        for i in range(tok.vocab_size):
            if i != tok.eot_id:
                vocab.setdefault(tok.token_bytes(i), []).append(i)
        self.vocab = Vocabulary(tok.eot_id, {k: v for k, v in vocab.items()})
        self.vocab_size = tok.vocab_size

    def compile(self, kind: str, value: str):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(value) if kind == "json" else value
        return Index(regex, self.vocab)

    def walk(self, index, tokens: list[int], eos: int) -> tuple[list[float], list[float], bool]:
        from outlines_core import Guide

        g = Guide(index)
        fills, accepts, ok = [], [], True
        for t in [*tokens, eos]:
            t0 = time.perf_counter()
            allowed = g.get_tokens()
            t1 = time.perf_counter()
            ok &= t in allowed
            t2 = time.perf_counter()
            if t != eos:
                g.advance(t)
            accepts.append(time.perf_counter() - t2)
            fills.append(t1 - t0)
        return fills, accepts, ok


ADAPTERS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}


def us(xs: list[float], q: float | None = None) -> float:
    xs = sorted(xs)
    v = statistics.median(xs) if q is None else xs[min(len(xs) - 1, int(q * len(xs)))]
    return round(v * 1e6, 1)


def run_one(lib: str, tok_name: str, repeats: int) -> dict[str, Any]:
    from bench.structured import SCHEMAS

    tok = load_tokenizer(tok_name)
    out: dict[str, Any] = {"library": lib, "tokenizer": tok_name, "vocab": tok.vocab_size}
    try:
        t0 = time.perf_counter()
        ad = ADAPTERS[lib](tok)
        out["tokenizer_s"] = round(time.perf_counter() - t0, 3)
    except Exception as e:  # not installed, or our tokenizer is refused
        out["error"] = f"{type(e).__name__}: {e}"[:300]
        return out
    cases = [(name, "json", json.dumps(schema), json.dumps(doc)) for name, (schema, doc) in SCHEMAS.items()]
    cases.append(("regex", "regex", REGEX, REGEX_SAMPLE))
    cases.append(("json_object", "json", '{"type": "object"}', '{"a": [1, {"b": null}], "c": "d"}'))
    out["cases"] = {}
    for name, kind, value, doc in cases:
        row: dict[str, Any] = {}
        try:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                compiled = ad.compile(kind, value)
                times.append(time.perf_counter() - t0)
            row["compile_ms"] = round(min(times) * 1000, 2)
            tokens = tok.encode(doc, allow_special=False)
            fills, accepts = [], []
            for _ in range(repeats):
                f, a, ok = ad.walk(compiled, tokens, tok.eot_id)
                fills += f
                accepts += a
            row.update(tokens=len(tokens) + 1, ok=bool(ok), fill_us_mean=round(statistics.mean(fills) * 1e6, 1),
                       fill_us_p50=us(fills), fill_us_p99=us(fills, 0.99), accept_us_p50=us(accepts))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        out["cases"][name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--libraries", default="xgrammar,llguidance,outlines-core")
    ap.add_argument("--tokenizers", default="shakespeare,r50k_base")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="structured-libs")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    results = [run_one(lib, tn, args.repeats) for lib in args.libraries.split(",")
               for tn in args.tokenizers.split(",")]
    versions = {}
    for mod in ("xgrammar", "llguidance", "outlines_core"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            try:
                from importlib.metadata import version

                versions[mod] = version(mod.replace("_", "-"))
            except Exception:
                versions[mod] = None
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["library"], r["tokenizer"], "-", r["error"][:60], "", "", "", "", ""])
            continue
        for name, c in r["cases"].items():
            rows.append([r["library"], r["tokenizer"], r["tokenizer_s"], name,
                         c.get("compile_ms", c.get("error", "")[:60]), c.get("fill_us_mean", ""),
                         c.get("fill_us_p50", ""), c.get("fill_us_p99", ""), c.get("ok", "")])
    print_table(["library", "tokenizer", "tok_s", "case", "compile_ms", "fill_us_mean", "fill_us_p50",
                 "fill_us_p99", "ok"], rows)
    path = write_result(args.out, {**env_info(), "benchmark": "structured-libs", "versions": versions,
                                   "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
