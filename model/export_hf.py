"""Export our checkpoint as a Hugging Face transformers GPT-2 directory.

    python -m model.export_hf --checkpoint DIR --out DIR

Writes what `GPT2LMHeadModel.from_pretrained` and `AutoTokenizer.from_pretrained` read:
config.json, model.safetensors (Conv1D weights transposed to (in, out), the head tied to
the token embedding and not stored), and the tokenizer as vocab.json + merges.txt (GPT-2's
byte-level BPE files), tokenizer.json (the same for the fast `tokenizers` backend),
tokenizer_config.json and special_tokens_map.json, with `<|endoftext|>` as bos/eos/unk, and a
checkpoint's extra special tokens as added tokens. A chat fine-tune's template goes into tokenizer_config.json
(`chat_template`) and its stop ids into generation_config.json (`eos_token_id`), so `apply_chat_template`
and vLLM render and stop as our server does.
The vocabulary and merges are converted from the tiktoken ranks (GPT-2's `r50k_base`, or
the checkpoint's own `.tiktoken` file), so nothing is downloaded. The inverse of
`python -m model.convert_hf`.

GPT-2 cannot express post-norm blocks, sinusoidal positions or bias-free layers; such a
checkpoint is refused. A vocabulary padded beyond the tokenizer's exports as is: config.json
keeps the model's vocab_size, the tokenizer has fewer ids.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from model.chat_template import (
    DEFAULT_TEMPLATE,
    GENERATION_CONFIG,
    ChatTemplateError,
    checkpoint_stop_tokens,
    load_chat_template,
)
from model.checkpoint import CheckpointError, load_checkpoint
from model.config import GPTConfig
from model.convert_hf import CONV1D
from model.tokenizer import EOT, GPT2_PATTERN, Tokenizer, TokenizerError

HF_ACTIVATION = {"gelu": "gelu_new", "relu": "relu"}  # ours "gelu" is GPT-2's tanh approximation
# GPT-2's pre-tokenization, as ours and as tiktoken writes it for r50k_base (possessive, same splits)
GPT2_PATTERNS = (GPT2_PATTERN, r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""")


class ExportError(ValueError):
    pass


def hf_config(config: GPTConfig, eot_id: int) -> dict[str, Any]:
    """Our GPTConfig as a GPT2Config dict; refuses what GPT-2 cannot express (the message names the field)."""
    if config.norm != "pre":
        raise ExportError(f"norm={config.norm!r} cannot be exported: GPT-2 blocks are pre-norm only")
    if config.position != "learned":
        raise ExportError(f"position={config.position!r} cannot be exported: GPT-2 has only a learned position table")
    if not config.bias:
        raise ExportError("bias=False cannot be exported: GPT-2 always has biases in its Linear and LayerNorm layers")
    if config.activation not in HF_ACTIVATION:
        raise ExportError(f"activation={config.activation!r} cannot be exported")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": HF_ACTIVATION[config.activation],
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "torch_dtype": "float32",
    }


def hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names → HF's (the same, `transformer.` prefixed); Linear (out, in) → Conv1D (in, out); no tied head."""
    return {k: (v.t() if k.endswith(CONV1D) else v).detach().to("cpu").contiguous()
            for k, v in state.items() if k != "lm_head.weight"}


# --------------------------------------------------------------------------- tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (as in its encoder.py / transformers)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tokenizer_ranks(tokenizer: Tokenizer) -> dict[bytes, int]:
    """The mergeable ranks {token bytes: id} of a tokenizer (every id but the special tokens)."""
    enc = tokenizer.encoding
    special = {enc.encode_single_token(t) for t in enc.special_tokens_set}
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab) if i not in special}
    if sorted(ranks.values()) != list(range(len(ranks))) or len(ranks) < 256:
        raise ExportError(f"tokenizer {enc.name!r}: ranks are not 0..n-1 covering the 256 bytes")
    if getattr(enc, "_pat_str", GPT2_PATTERN) not in GPT2_PATTERNS:
        raise ExportError(f"tokenizer {enc.name!r}: pre-tokenization pattern is not GPT-2's")
    return ranks


def ranks_to_bpe(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken ranks → GPT-2 BPE vocab and merges (tokens spelled with bytes_to_unicode).

    tiktoken encodes a piece by repeatedly merging the adjacent pair whose concatenation has the lowest
    rank. For each multi-byte token in rank order, every split into two tokens of the vocabulary is a merge
    that can produce it; the split with the lowest max-rank comes first (the merge BPE training made), the
    other splits follow it, so that a BPE applying merges in list order takes tiktoken's steps.
    """
    b2u = bytes_to_unicode()

    def spell(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        vocab[spell(token)] = rank
        if len(token) == 1:
            continue
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        if not any(max(ranks[a], ranks[b]) < rank for a, b in splits):
            raise ExportError(f"token {rank} ({token!r}) is not a merge of two lower-ranked tokens; not a BPE")
        splits.sort(key=lambda s: (max(ranks[s[0]], ranks[s[1]]), ranks[s[0]]))
        merges.extend((spell(a), spell(b)) for a, b in splits)
    return vocab, merges


def write_tokenizer(tokenizer: Tokenizer, out: Path, model_max_length: int,
                    bpe: tuple[dict[str, int], list[tuple[str, str]]] | None = None,
                    chat: dict[str, Any] | None = None) -> None:
    """vocab.json, merges.txt, tokenizer.json, tokenizer_config.json and special_tokens_map.json.

    bpe: `ranks_to_bpe(tokenizer_ranks(tokenizer))` when already computed. The tokenizer's extra special tokens
    (a chat fine-tune's `<|user|>`, a task's `[Start]`) become added special tokens with their ids, so a
    rendered template tokenizes to the same ids in transformers as in ours (Tokenizer.encode_chat). chat: the
    checkpoint's chat template, bos and eos tokens (chat_settings), written into tokenizer_config.json."""
    vocab, merges = bpe or ranks_to_bpe(tokenizer_ranks(tokenizer))
    vocab = dict(vocab)
    eot = tokenizer.eot_id
    if eot in vocab.values() or EOT in vocab:
        raise ExportError(f"tokenizer: id {eot} of {EOT} collides with a BPE token")
    vocab[EOT] = eot
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")

    from tokenizers import AddedToken, decoders, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    # ignore_merges: a piece that is a whole token is that token, as tiktoken does before merging
    fast = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's pattern
    fast.decoder = decoders.ByteLevel()
    fast.post_processor = processors.ByteLevel(trim_offsets=False)
    # the special tokens in id order: transformers gives each added token the next id, so they must follow the
    # vocabulary without a gap (they do: Tokenizer.with_special_tokens hands out the next free ids)
    specials = sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
    for k, (name, i) in enumerate(specials):
        if i != len(vocab) - 1 + k:
            raise ExportError(f"tokenizer: special token {name!r} has id {i}, not the next free id "
                              f"{len(vocab) - 1 + k}")
    fast.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in specials])
    fast.save(str(out / "tokenizer.json"))

    chat = chat or {}
    eos = chat.get("eos_token") or EOT
    special = {"bos_token": chat.get("bos_token") or EOT, "eos_token": eos, "unk_token": EOT}
    added = {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for name, i in specials}
    extra = [name for name, _ in specials if name != EOT]
    config = {"tokenizer_class": "GPT2Tokenizer", **special, "add_bos_token": False, "add_prefix_space": False,
              "errors": "replace", "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
              "added_tokens_decoder": added, **({"additional_special_tokens": extra} if extra else {}),
              **({"chat_template": chat["chat_template"]} if chat.get("chat_template") else {})}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {**special, **({"additional_special_tokens": extra} if extra else {})}, indent=2) + "\n")


def chat_settings(checkpoint: Path, tokenizer: Tokenizer) -> tuple[dict[str, Any] | None, list[int] | None]:
    """The chat template (with its bos/eos tokens) the checkpoint carries, or None (a base model: the server's
    transcript default is not exported); and the ids generation stops at (its generation_config.json)."""
    try:
        t = load_chat_template(checkpoint, EOT)  # the transcript default where the checkpoint has no template
    except ChatTemplateError as e:
        raise ExportError(str(e)) from None
    template = None
    if t.source != DEFAULT_TEMPLATE:
        template = {"chat_template": t.source, "bos_token": t.bos_token, "eos_token": t.eos_token}
    stop_ids = None
    if (checkpoint / GENERATION_CONFIG).is_file():
        stops = checkpoint_stop_tokens(checkpoint, EOT)
        stop_ids = sorted({tokenizer.eot_id, *(tokenizer.special_tokens[s] for s in stops)})
    return template, stop_ids


# --------------------------------------------------------------------------- export


def export(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the Hugging Face directory `out_dir` for the checkpoint directory `checkpoint`."""
    ck = load_checkpoint(checkpoint)
    config = hf_config(ck.config, ck.tokenizer.eot_id)  # refuse before writing anything
    bpe = ranks_to_bpe(tokenizer_ranks(ck.tokenizer))
    out = Path(out_dir)
    if out.resolve() == ck.path.resolve():
        raise ExportError(f"{out}: --out must differ from the checkpoint directory")
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_state(ck.model.state_dict()), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    chat, stop_ids = chat_settings(ck.path, ck.tokenizer)
    write_tokenizer(ck.tokenizer, out, ck.config.block_size, bpe, chat)
    if stop_ids is not None:  # transformers' generate and vLLM stop at any of eos_token_id
        gen = {"bos_token_id": ck.tokenizer.eot_id, "eos_token_id": stop_ids}
        (out / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.export_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="our checkpoint directory")
    ap.add_argument("--out", required=True, help="Hugging Face directory to write (created if missing)")
    args = ap.parse_args(argv)
    try:
        path = export(args.checkpoint, args.out)
    except (ExportError, CheckpointError, TokenizerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
