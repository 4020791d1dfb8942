"""Structured output: what a grammar-constrained step costs next to an unconstrained one.

    python -m bench.structured [--models gpt2,stack] [--batches 1,16,64] [--steps 32] [--repeats 3]
                               [--threads 2] [--device cpu] [--out structured]

Per model (`gpt2`: a random GPT-2 124M, bench.common.random_gpt2; `stack`: the stack-ceiling model of
bench/stack.py, one layer, n_embd 64, GPT-2's vocabulary) and batch size B: an engine core
(`model.engine_core.EngineCore`, B slots) decodes B requests of temperature 0.8 (seeded) for `--steps` steps,
with 0, 1 or all B rows constrained by the ~10-field JSON schema `record` (SCHEMAS), and, as the reference, the
same core where no request is constrained. Reported: ms per decode step (median over repeats, after the prefill
and one warm step), tokens/s, and the ratios constrained/unconstrained: `none` (the feature unused: the
≤ 2% goal), `one` and `all` (the 64-stream goal: all/none ≥ 0.7 on the stack-ceiling model). The runs of each
cell are interleaved (none, one, all, none, ...) so drift hits them alike. A constrained request whose
document completes early is replaced by a fresh one (same schema), so every step keeps B rows.

Then the grammar compile time per schema (cold: a fresh compiler each time) on GPT-2's vocabulary.

Writes bench/results/<out>.json and prints tables.
"""

from __future__ import annotations

from typing import Any

# name → (schema, a document that satisfies it). Tests sample these too (tests/test_structured_output.py).
SCHEMAS: dict[str, tuple[dict, Any]] = {
    "object": ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                "required": ["name", "age"], "additionalProperties": False},
               {"name": "Romeo", "age": 16}),
    "array": ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
               "minItems": 1, "maxItems": 4},
              [3, 14, 15]),
    "enum": ({"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "angry"]},
                                                "ok": {"type": "boolean"}},
              "required": ["mood", "ok"], "additionalProperties": False},
             {"mood": "sad", "ok": True}),
    "nested": ({"type": "object", "properties": {
                   "play": {"type": "object", "properties": {
                       "title": {"type": "string", "maxLength": 16},
                       "acts": {"type": "array", "items": {"type": "object", "properties": {
                           "n": {"type": "integer", "minimum": 1, "maximum": 5}},
                           "required": ["n"], "additionalProperties": False}, "maxItems": 2}},
                       "required": ["title", "acts"], "additionalProperties": False}},
                "required": ["play"], "additionalProperties": False},
               {"play": {"title": "Hamlet", "acts": [{"n": 1}, {"n": 2}]}}),
    "pattern": ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                                   "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]$"}},
                 "required": ["code", "date"], "additionalProperties": False},
                {"code": "AB-123", "date": "2024-07"}),
    "numbers": ({"type": "object", "properties": {
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                    "count": {"type": "integer", "minimum": -5, "maximum": 5},
                    "year": {"type": "integer", "exclusiveMinimum": 1900, "exclusiveMaximum": 2100}},
                 "required": ["score", "count", "year"], "additionalProperties": False},
                {"score": 0.5, "count": -3, "year": 1999}),
    # ~10 fields of every kind: the benchmark's schema
    "record": ({"type": "object", "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
                    "name": {"type": "string", "maxLength": 20},
                    "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
                    "active": {"type": "boolean"},
                    "role": {"enum": ["admin", "user", "guest"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 100},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                                 "zip": {"type": "string",
                                                                         "pattern": "^[0-9]{5}$"}},
                                "required": ["city", "zip"], "additionalProperties": False},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "note": {"type": ["string", "null"], "maxLength": 24}},
                "required": ["id", "name", "email", "active", "role", "score", "tags", "address", "age", "note"],
                "additionalProperties": False},
               {"id": 7, "name": "Juliet", "email": "jc@verona.org", "active": True, "role": "user", "score": 99.5,
                "tags": ["a", "b"], "address": {"city": "Verona", "zip": "37121"}, "age": 13, "note": None}),
}
BENCH_SCHEMA = "record"
