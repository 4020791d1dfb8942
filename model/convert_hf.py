"""Import a Hugging Face GPT-2 directory as our checkpoint.

    python -m model.convert_hf --hf-dir DIR --out DIR

DIR holds `config.json` and `model.safetensors` or `pytorch_model.bin` (what
`save_pretrained` writes, or a hub snapshot of gpt2 / gpt2-medium / ...). HF's GPT-2
uses Conv1D layers whose weights are stored (in, out); ours are nn.Linear (out, in),
so those are transposed. The head is tied to the token embedding. The tokenizer is
GPT-2's `r50k_base`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from model.checkpoint import save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import Tokenizer, TokenizerError

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


class ConversionError(ValueError):
    pass


def hf_config_to_ours(hf: dict) -> GPTConfig:
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ConversionError(f"model_type {hf.get('model_type')!r} is not gpt2")
    act = hf.get("activation_function", "gelu_new")
    if act not in GELU_TANH + ("relu",):
        raise ConversionError(f"activation_function {act!r} is not supported (GPT-2 uses gelu_new)")
    n_embd = hf["n_embd"]
    if hf.get("n_inner") not in (None, 4 * n_embd):
        raise ConversionError(f"n_inner {hf['n_inner']} != 4 * n_embd is not supported")
    for flag, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                     ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if hf.get(flag, ok) != ok:
            raise ConversionError(f"{flag}={hf[flag]} is not supported")
    return GPTConfig(vocab_size=hf["vocab_size"], block_size=hf.get("n_positions", 1024), n_layer=hf["n_layer"],
                     n_head=hf["n_head"], n_embd=n_embd, dropout=0.0, bias=True,
                     activation="relu" if act == "relu" else "gelu",
                     layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5))


def load_hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    if (hf_dir / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(hf_dir / "model.safetensors"))
    if (hf_dir / "pytorch_model.bin").is_file():
        return torch.load(hf_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ConversionError(f"{hf_dir}: neither model.safetensors nor pytorch_model.bin found")


def convert_state(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names → ours: add the `transformer.` prefix where missing, transpose Conv1D, drop buffers and the head."""
    out = {}
    for name, t in hf_state.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue  # causal-mask buffers of old checkpoints; the head is tied to wte
        key = name if name.startswith("transformer.") else f"transformer.{name}"
        out[key] = t.t().contiguous() if key.endswith(CONV1D) else t
    return out


def convert(hf_dir: str | Path, out_dir: str | Path) -> Path:
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise ConversionError(f"{hf_dir}: no config.json (is this a Hugging Face model directory?)")
    config = hf_config_to_ours(json.loads((hf_dir / "config.json").read_text()))
    state = convert_state(load_hf_state(hf_dir))
    model = GPT(config)
    expected = {k: v.shape for k, v in model.state_dict().items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ConversionError(f"{hf_dir}: weights do not match config.json (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    for k, s in expected.items():
        if state[k].shape != s:
            raise ConversionError(f"{hf_dir}: {k} has shape {tuple(state[k].shape)}, expected {tuple(s)}")
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    tokenizer = Tokenizer.named("r50k_base")
    return save_checkpoint(out_dir, model, tokenizer,
                           {"produced_by": "model.convert_hf", "source": str(hf_dir.resolve())})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.convert_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", required=True, help="Hugging Face GPT-2 directory (config.json + weights)")
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    args = ap.parse_args(argv)
    try:
        path = convert(args.hf_dir, args.out)
    except (ConversionError, TokenizerError, KeyError, OSError) as e:
        print(f"error: {e if not isinstance(e, KeyError) else f'config.json lacks {e}'}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
