"""Export our checkpoint as a GGUF file for llama.cpp (llama-server, llama-cli, ...) and ollama.

    python -m model.export_gguf --checkpoint DIR --out FILE.gguf [--type f32|f16|q8_0]

Written with `gguf`, the Python package llama.cpp maintains (gguf-py), in llama.cpp's `gpt2` architecture:
token_embd, position_embd, blk.N.{attn_norm, attn_qkv, attn_output, ffn_norm, ffn_up, ffn_down} with their
biases, output_norm. The head is tied and not written: llama.cpp's gpt2 loader (src/models/gpt2.cpp of the
vendored tree) takes `output` as optional and falls back to token_embd. Metadata: context length, embedding
and feed-forward length, block count, heads, layer-norm epsilon, file type.

The tokenizer is the checkpoint's own (GPT-2's `r50k_base` or a trained `.tiktoken`), converted to GPT-2 BPE
vocabulary and merges as `model.export_hf` does: `tokenizer.ggml.model = gpt2`, `tokenizer.ggml.pre = gpt-2`
(our pre-tokenization regex is GPT-2's), token types (special tokens are control tokens; ids of a vocabulary
padded beyond the tokenizer become unused `[PADn]` tokens), bos = eos = `<|endoftext|>`, and no BOS added to
prompts (our server adds none). A chat template (`chat_template.jinja`, or `chat_template` in
`tokenizer_config.json`, found as model/chat_template.py finds it) is carried along when the checkpoint has one,
with the end-of-turn token its generation_config.json stops at (a chat fine-tune's `<|im_end|>`) as
`tokenizer.ggml.eot_token_id`; without one, llama.cpp uses its own default, not our server's `You:` / `Model:`
transcript.

--type: f32 keeps every weight exact; f16 and q8_0 convert the 2-D weights (token_embd and the block matrices)
and keep norms, biases and position_embd in f32, as llama.cpp's convert_hf_to_gguf.py does; a matrix whose rows
are not a multiple of q8_0's 32-value block falls back to f16. Smaller types (q4_0, q4_K_M, ...): run
llama.cpp's `llama-quantize` on the f32 file.

What llama.cpp's gpt2 graph can compute: pre-norm blocks, a position table added to the token embeddings, GELU
(tanh approximation), biases. So post-norm checkpoints and ReLU checkpoints are refused (one line naming the
field); sinusoidal positions are a fixed table and are written as position_embd; bias=False is written as zero
biases (the loader requires them). The bundled checkpoints/shakespeare (pre-norm, learned positions, GELU,
biases) exports as is.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.chat_template import TRANSCRIPT_ORIGIN, ChatTemplate, ChatTemplateError, load_chat_template
from model.checkpoint import CheckpointError, load_checkpoint
from model.config import GPTConfig
from model.export_hf import ExportError, ranks_to_bpe, tokenizer_ranks
from model.tokenizer import EOT, Tokenizer, TokenizerError

ARCH = "gpt2"
TYPES = ("f32", "f16", "q8_0")


def _gguf():
    try:
        import gguf
    except ImportError as e:  # an optional extra: say how to get it
        raise ExportError("the `gguf` package is not installed: pip install -e '.[gguf]' (gguf>=0.17)"
                          ) from e
    return gguf


def check_config(config: GPTConfig) -> None:
    """Refuse what llama.cpp's gpt2 graph cannot compute; the message names the field."""
    if config.norm != "pre":
        raise ExportError(f"norm={config.norm!r} cannot be exported to GGUF: llama.cpp's gpt2 architecture has "
                          "pre-norm blocks only")
    if config.activation != "gelu":
        raise ExportError(f"activation={config.activation!r} cannot be exported to GGUF: llama.cpp's gpt2 "
                          "architecture applies GELU (tanh approximation) only")


def gguf_tensors(model: torch.nn.Module, config: GPTConfig) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in our (out, in) layout, which is ggml's {in, out}) for every tensor written."""
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    c = config.n_embd

    def get(name: str, zeros: tuple[int, ...] | None = None) -> np.ndarray:
        if name in state:
            return state[name].numpy()
        if zeros is not None:  # bias=False: a zero bias computes the same
            return np.zeros(zeros, dtype=np.float32)
        raise ExportError(f"tensor {name} is missing from the model")

    if config.position == "learned":
        pos = get("transformer.wpe.weight")
    else:  # sinusoidal: the fixed table the model adds, written as a learned one
        pos = model.pos_table.detach().to("cpu", torch.float32).numpy()
    out = [("token_embd.weight", get("transformer.wte.weight")), ("position_embd.weight", pos)]
    # ours → llama.cpp's name, with the bias length
    parts = (("ln_1", "attn_norm", c), ("attn.c_attn", "attn_qkv", 3 * c), ("attn.c_proj", "attn_output", c),
             ("ln_2", "ffn_norm", c), ("mlp.c_fc", "ffn_up", 4 * c), ("mlp.c_proj", "ffn_down", c))
    for i in range(config.n_layer):
        for ours_name, theirs, n_out in parts:
            prefix = f"transformer.h.{i}.{ours_name}"
            out.append((f"blk.{i}.{theirs}.weight", get(f"{prefix}.weight")))
            out.append((f"blk.{i}.{theirs}.bias", get(f"{prefix}.bias", (n_out,))))
    out.append(("output_norm.weight", get("transformer.ln_f.weight")))
    out.append(("output_norm.bias", get("transformer.ln_f.bias", (c,))))
    return [(name, np.ascontiguousarray(a, dtype=np.float32)) for name, a in out]


def quantized(gguf: Any, name: str, data: np.ndarray, kind: str) -> tuple[np.ndarray, Any]:
    """(data to write, its GGML type): 1-D tensors and position_embd stay f32, as convert_hf_to_gguf.py keeps them."""
    q = gguf.GGMLQuantizationType
    if kind == "f32" or data.ndim < 2 or name == "position_embd.weight":
        return data, q.F32
    if kind == "q8_0":
        try:
            return gguf.quants.quantize(data, q.Q8_0), q.Q8_0
        except gguf.QuantError:  # rows not a multiple of 32: f16, as convert_hf_to_gguf.py falls back
            pass
    return gguf.quants.quantize(data, q.F16), q.F16


def vocabulary(tokenizer: Tokenizer, vocab_size: int, gguf: Any) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) for `vocab_size` ids: BPE tokens spelled as GPT-2's vocab.json spells them."""
    vocab, merges = ranks_to_bpe(tokenizer_ranks(tokenizer))
    types = gguf.TokenType
    tokens: list[str | None] = [None] * vocab_size
    kinds = [int(types.UNUSED)] * vocab_size
    for text, i in vocab.items():
        tokens[i], kinds[i] = text, int(types.NORMAL)
    for name, i in tokenizer.special_tokens.items():
        if tokens[i] is not None or name in vocab:
            raise ExportError(f"tokenizer: special token {name!r} = {i} collides with a BPE token")
        tokens[i], kinds[i] = name, int(types.CONTROL)
    taken = {t for t in tokens if t is not None}
    for i, t in enumerate(tokens):
        if t is None:  # a vocabulary padded beyond the tokenizer (convert_hf_to_gguf.py's names)
            tokens[i] = f"[PAD{i}]"
            if tokens[i] in taken:
                raise ExportError(f"tokenizer: padding token name {tokens[i]!r} is also a real token")
    return tokens, kinds, [f"{a} {b}" for a, b in merges]


def chat_template(checkpoint_dir: Path) -> ChatTemplate | None:
    """The checkpoint's own Jinja chat template (model/chat_template.py finds it, as the server does), its stop
    list the special tokens generation_config.json adds to <|endoftext|> (a chat fine-tune's end of turn); or None."""
    try:
        template = load_chat_template(checkpoint_dir, EOT)
    except ChatTemplateError as e:
        raise ExportError(str(e)) from None
    return None if template.origin == TRANSCRIPT_ORIGIN else template


def export(checkpoint: str | Path, out_file: str | Path, kind: str = "f32") -> Path:
    """Write `out_file` (GGUF, weights as `kind`) for the checkpoint directory `checkpoint`; atomic."""
    if kind not in TYPES:
        raise ExportError(f"--type {kind!r}: choose one of {', '.join(TYPES)}")
    gguf = _gguf()
    ck = load_checkpoint(checkpoint)
    config = ck.config
    check_config(config)  # refuse before writing anything
    tokens, token_types, merges = vocabulary(ck.tokenizer, config.vocab_size, gguf)
    template = chat_template(ck.path)
    special = ck.tokenizer.special_tokens
    eot = None if template is None else next((special[n] for n in template.stop if n in special), None)
    out = Path(out_file)
    if out.is_dir():
        raise ExportError(f"{out}: --out is a directory; give a file name such as model.gguf")
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch=ARCH)
    try:
        writer.add_name(ck.path.resolve().name)
        writer.add_context_length(config.block_size)
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(4 * config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tokens)
        writer.add_token_types(token_types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(ck.tokenizer.eot_id)
        writer.add_eos_token_id(ck.tokenizer.eot_id)
        writer.add_add_bos_token(False)
        writer.add_add_eos_token(False)
        if template is not None:
            writer.add_chat_template(template.source)
        if eot is not None:  # a turn that ends with its own token (ChatML's <|im_end|>): llama.cpp stops there too
            writer.add_eot_token_id(eot)

        for name, data in gguf_tensors(ck.model, config):
            qdata, qtype = quantized(gguf, name, data, kind)
            writer.add_tensor(name, qdata, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.export_gguf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="our checkpoint directory")
    ap.add_argument("--out", required=True, help="GGUF file to write (replaced atomically)")
    ap.add_argument("--type", default="f32", choices=TYPES,
                    help="weight type of the matrices (default f32; norms, biases and positions stay f32)")
    args = ap.parse_args(argv)
    try:
        path = export(args.checkpoint, args.out, args.type)
    except (ExportError, CheckpointError, TokenizerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {args.type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
