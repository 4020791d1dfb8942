"""The on-disk format of a quantized checkpoint: what `python -m model.quantize` (model/quantize.py) writes and
`load_checkpoint` (model/checkpoint.py) reads and checks.

A quantized checkpoint is a checkpoint directory (safetensors, no pickle) holding, beside the source's files,
`quantization.json` ({"mode", "group_size"}) and, in model.safetensors, for each block Linear

    int8:  <name>.weight        int8 (out, in)          <name>.weight_scale  fp32 (out,)
    int4:  <name>.weight        uint8 (out, in/2)       two weights a byte, the even input in the low nibble
           <name>.weight_scale  fp32 (out, in/group)    <name>.weight_zero   fp32 (out, in/group)

and the tied embedding / head as int8 rows (`transformer.wte.weight`, `transformer.wte.weight_scale`), the
formats of model/linear.py (`quantize_int8`, `quantize_int4`): serving a saved int8 checkpoint gives the tokens of
serving the fp32 one with `--quantize int8`. LayerNorms, biases and position embeddings stay as they were.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from model.linear import (
    DEFAULT_INT4_GROUP,
    INT4_GROUPS,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    check_int4_shape,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)

QUANTIZATION = "quantization.json"
EMBEDDING = "transformer.wte.weight"


def quantize_state(state: dict[str, torch.Tensor], linear_names: list[str], mode: str,
                   group: int = DEFAULT_INT4_GROUP) -> dict[str, torch.Tensor]:
    """An fp32 state dict (as stored: the head tied to the embedding) → the quantized tensors to store."""
    out = dict(state)
    if mode == "int4":
        for name in linear_names:
            check_int4_shape(tuple(state[f"{name}.weight"].shape), group, name)
    for name in linear_names:
        w = state[f"{name}.weight"]
        if mode == "int8":
            out[f"{name}.weight"], out[f"{name}.weight_scale"] = quantize_int8(w)
        else:
            q, scale, zero = quantize_int4(w, group)
            out[f"{name}.weight"] = pack_nibbles(q)
            out[f"{name}.weight_scale"], out[f"{name}.weight_zero"] = scale, zero
    out[EMBEDDING], out[f"{EMBEDDING[:-len('.weight')]}.weight_scale"] = quantize_int8(state[EMBEDDING])
    return {k: v.contiguous() for k, v in out.items()}


def read_quantization(path: Path) -> dict | None:
    """A checkpoint's quantization.json, checked; None for an unquantized checkpoint. ValueError names the file."""
    f = path / QUANTIZATION
    if not f.is_file():
        return None
    try:
        q = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(q, dict) or q.get("mode") not in ("int8", "int4"):
        raise ValueError(f"{f}: mode must be int8 or int4, got {q.get('mode') if isinstance(q, dict) else q!r}")
    if q["mode"] == "int4" and q.get("group_size") not in INT4_GROUPS:
        raise ValueError(f"{f}: int4 group_size must be one of {INT4_GROUPS}, got {q.get('group_size')!r}")
    return q


def expected_tensors(linear_names: list[str], q: dict) -> dict[str, str]:
    """Stored name → dtype name of every quantized tensor a checkpoint of this mode must hold."""
    want = {EMBEDDING: "int8", "transformer.wte.weight_scale": "float32"}
    for name in linear_names:
        if q["mode"] == "int8":
            want |= {f"{name}.weight": "int8", f"{name}.weight_scale": "float32"}
        else:
            want |= {f"{name}.weight": "uint8", f"{name}.weight_scale": "float32", f"{name}.weight_zero": "float32"}
    return want


def check_quantized_state(state: dict[str, torch.Tensor], linear_names: list[str], q: dict, where: str) -> None:
    problems = []
    for k, dt in expected_tensors(linear_names, q).items():
        if k not in state:
            problems.append(f"missing tensor {k}")
        elif str(state[k].dtype).removeprefix("torch.") != dt:
            problems.append(f"tensor {k} is {str(state[k].dtype).removeprefix('torch.')}, {q['mode']} needs {dt}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"{where}: quantized as {q['mode']} ({QUANTIZATION}) but " + "; ".join(problems[:3]) + more)


def install_quantized(model: nn.Module, places: list[tuple[str, nn.Module, str]], state: dict[str, torch.Tensor],
                      q: dict, device: torch.device, dtype: torch.dtype) -> None:
    """Put the stored int8/int4 tensors into `model` (already on `device` in `dtype` but for its block Linears
    and embedding) as model/linear.py's served modules; `places`: (name, parent module, attribute) of each Linear."""
    group = q.get("group_size") or DEFAULT_INT4_GROUP
    for name, parent, child_name in places:
        bias = state.get(f"{name}.bias")
        bias = None if bias is None else bias.to(device)
        w, scale = state[f"{name}.weight"].to(device), state[f"{name}.weight_scale"].to(device)
        if q["mode"] == "int8":
            new = Int8Linear(w, scale, bias, dtype)
        else:
            new = Int4Linear(unpack_nibbles(w), scale, state[f"{name}.weight_zero"].to(device), bias, dtype, group)
        setattr(parent, child_name, new)
    emb = Int8Embedding.from_quantized(state[EMBEDDING].to(device), state["transformer.wte.weight_scale"].to(device),
                                       dtype)
    model.transformer.wte = emb
    model.lm_head = emb.head


def quantized_keys(state: dict[str, torch.Tensor], q: dict | None) -> set[str]:
    if q is None:
        return set()
    return {k for k in state if k.endswith((".weight_scale", ".weight_zero"))} | {
        k[: -len("_scale")] for k in state if k.endswith(".weight_scale")}
