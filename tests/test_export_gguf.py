"""GGUF export (model/export_gguf.py): read back with gguf's own reader, tensors, metadata and tokenizer equal
ours; refusals are one line. The slow test loads the files into llama.cpp (llama-tokenize, llama-server) and
checks its token ids and greedy tokens against ours."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.export_gguf import export, main
from model.export_hf import ExportError, bytes_to_unicode
from model.gpt import sinusoidal_table
from model.tokenizer import EOT, GPT2_PATTERN, Tokenizer
from tests.helpers import REPO, tiny_model, write_byte_ranks

gguf = pytest.importorskip("gguf")

BUNDLED = REPO / "checkpoints" / "shakespeare"
SHARED_DATA = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
TEXTS = [
    "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n",
    "  leading and trailing spaces   ",
    "tabs\tand\nnew\n\n\nlines \n\r\n",
    "unicode: café naïve Ωμέγα 東京 🙂 z̧ ¿qué? 1234567 numbers 3.14159 's 're 've 'll don't I'M",
]
OURS_TO_GGUF = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
                "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}


def read(path: Path) -> tuple[dict, dict]:
    """(metadata {key: value}, tensors {name: (type name, float32 array in numpy's (rows, cols) order)})."""
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    tensors = {t.name: (t.tensor_type.name, np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
                        .reshape(tuple(int(n) for n in reversed(t.shape))))
               for t in reader.tensors}
    return fields, tensors


def expected_tensors(ck) -> dict[str, np.ndarray]:
    """Our state dict under llama.cpp's names (written here independently of the exporter's own mapping)."""
    state = {k: v.detach().float().numpy() for k, v in ck.model.state_dict().items()}
    out = {"token_embd.weight": state["transformer.wte.weight"],
           "position_embd.weight": state["transformer.wpe.weight"],
           "output_norm.weight": state["transformer.ln_f.weight"], "output_norm.bias": state["transformer.ln_f.bias"]}
    for i in range(ck.config.n_layer):
        for ours, theirs in OURS_TO_GGUF.items():
            for p in ("weight", "bias"):
                out[f"blk.{i}.{theirs}.{p}"] = state[f"transformer.h.{i}.{ours}.{p}"]
    return out


def bpe_encode(text: str, tokens: list[str], merges: list[str]) -> list[int]:
    """GPT-2's byte-level BPE (pre-tokenize, then apply the lowest-ranked merge first) over the GGUF's tokens and
    merges, as llama.cpp's gpt2 tokenizer does: an independent check that the merges reproduce tiktoken."""
    import regex

    b2u = bytes_to_unicode()
    ids = {t: i for i, t in enumerate(tokens)}
    rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    out: list[int] = []
    for piece in regex.findall(GPT2_PATTERN, text):
        word = [b2u[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(rank.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(word, word[1:]))]
            best, i = min(pairs)
            if best == 1 << 30:
                break
            word[i:i + 2] = [word[i] + word[i + 1]]
        out += [ids[w] for w in word]
    return out


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bundled")
    return {kind: export(BUNDLED, tmp / f"shakespeare-{kind}.gguf", kind) for kind in ("f32", "f16", "q8_0")}


@pytest.fixture(scope="module")
def imported_gpt2(tmp_path_factory, gpt2_tokenizer):
    """A random small GPT-2 from transformers, imported with model.convert_hf (r50k_base tokenizer)."""
    transformers = pytest.importorskip("transformers")
    from model.convert_hf import convert

    tmp = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    # a wider init than GPT-2's 0.02 so that greedy choices are not near-ties (the slow test compares them)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=128, n_embd=64, n_layer=2, n_head=2,
                                     initializer_range=0.1)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp / "hf")
    ck = convert(tmp / "hf", tmp / "ck")
    return ck, export(ck, tmp / "gpt2-f32.gguf", "f32")


def test_bundled_model_f32_round_trips_exactly_with_its_metadata(bundled):
    ck = load_checkpoint(BUNDLED)
    fields, tensors = read(bundled["f32"])
    want = expected_tensors(ck)
    assert set(tensors) == set(want)  # no output.weight: the head is tied, llama.cpp falls back to token_embd
    for name, w in want.items():
        kind, got = tensors[name]
        assert kind == "F32" and got.shape == w.shape, name
        np.testing.assert_array_equal(got, w, err_msg=name)
    c = ck.config
    assert fields["general.architecture"] == "gpt2"
    assert fields["general.name"] == "shakespeare"
    assert fields["general.file_type"] == gguf.LlamaFileType.ALL_F32
    assert fields["gpt2.context_length"] == c.block_size
    assert fields["gpt2.embedding_length"] == c.n_embd
    assert fields["gpt2.feed_forward_length"] == 4 * c.n_embd
    assert fields["gpt2.block_count"] == c.n_layer
    assert fields["gpt2.attention.head_count"] == c.n_head
    assert fields["gpt2.attention.layer_norm_epsilon"] == pytest.approx(c.layer_norm_epsilon)
    assert "tokenizer.chat_template" not in fields  # the bundled model has none


def test_bundled_tokenizer_is_ours(bundled):
    ck = load_checkpoint(BUNDLED)
    tok = ck.tokenizer
    fields, _ = read(bundled["f32"])
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == ck.config.vocab_size
    u2b = {u: b for b, u in bytes_to_unicode().items()}
    for i, t in enumerate(tokens):
        if i == tok.eot_id:
            assert (t, types[i]) == (EOT, gguf.TokenType.CONTROL)
        else:
            assert bytes(u2b[ch] for ch in t) == tok.token_bytes(i) and types[i] == gguf.TokenType.NORMAL, i
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.bos_token_id"] == fields["tokenizer.ggml.eos_token_id"] == tok.eot_id
    assert fields["tokenizer.ggml.add_bos_token"] is False
    merges = fields["tokenizer.ggml.merges"]
    for text in TEXTS:
        assert bpe_encode(text, tokens, merges) == tok.encode(text), text


@pytest.mark.parametrize("kind, qtype, file_type, rtol", [("f16", "F16", "MOSTLY_F16", 1e-3),
                                                          ("q8_0", "Q8_0", "MOSTLY_Q8_0", 1 / 127)])
def test_bundled_model_f16_and_q8_0_within_tolerance(bundled, kind, qtype, file_type, rtol):
    ck = load_checkpoint(BUNDLED)
    fields, tensors = read(bundled[kind])
    assert fields["general.file_type"] == gguf.LlamaFileType[file_type]
    assert fields["tokenizer.ggml.tokens"] == read(bundled["f32"])[0]["tokenizer.ggml.tokens"]
    for name, w in expected_tensors(ck).items():
        got_type, got = tensors[name]
        if w.ndim == 1 or name == "position_embd.weight":  # kept f32, as convert_hf_to_gguf.py does
            assert got_type == "F32", name
            np.testing.assert_array_equal(got, w, err_msg=name)
        else:
            assert got_type == qtype and got.shape == w.shape, name
            # f16: relative rounding; q8_0: each block of 32 is scaled by its max |w| / 127, error <= half a step
            tol = np.abs(w).max(axis=-1, keepdims=True) * rtol + 1e-8 if kind == "q8_0" else np.abs(w) * rtol + 1e-7
            assert (np.abs(got - w) <= tol).all(), name
    assert bundled[kind].stat().st_size < bundled["f32"].stat().st_size * (0.55 if kind == "f16" else 0.32)


def test_imported_gpt2_exports_with_gpt2_vocabulary(imported_gpt2, gpt2_tokenizer):
    ck_dir, path = imported_gpt2
    ck = load_checkpoint(ck_dir)
    fields, tensors = read(path)
    for name, w in expected_tensors(ck).items():
        np.testing.assert_array_equal(tensors[name][1], w, err_msg=name)
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == 50257 and tokens[50256] == EOT
    assert tokens[:3] == ["!", '"', "#"] and tokens[262] == "Ġthe"  # GPT-2's vocab.json
    assert fields["tokenizer.ggml.merges"][:2] == ["Ġ t", "Ġ a"]  # GPT-2's merges.txt begins so
    assert fields["tokenizer.ggml.bos_token_id"] == 50256
    assert fields["gpt2.context_length"] == 128 and fields["gpt2.embedding_length"] == 64


def test_sinusoidal_positions_and_no_bias_padded_vocab(tmp_path):
    """Sinusoidal positions become the fixed position_embd table; bias=False becomes zero biases; ids beyond the
    tokenizer are unused [PADn] tokens; q8_0 falls back to f16 for rows that are not a multiple of 32."""
    tok = Tokenizer.from_ranks_file(write_byte_ranks(tmp_path / "bytes.tiktoken", [b"th", b"he", b" t"]))
    model = tiny_model(position="sinusoidal", bias=False, n_embd=48, block_size=32)
    ck = save_checkpoint(tmp_path / "ck", model, tok, tokenizer_file=tmp_path / "bytes.tiktoken")
    fields, tensors = read(export(ck, tmp_path / "a.gguf", "q8_0"))
    np.testing.assert_array_equal(tensors["position_embd.weight"][1], sinusoidal_table(32, 48).numpy())
    assert tensors["blk.0.attn_qkv.bias"][1].shape == (3 * 48,) and not tensors["blk.1.ffn_up.bias"][1].any()
    assert not tensors["output_norm.bias"][1].any()
    assert tensors["token_embd.weight"][0] == "F16"  # 48 is not a multiple of q8_0's block of 32
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == 512 and tokens[259] == EOT and types[259] == gguf.TokenType.CONTROL
    assert tokens[300] == "[PAD300]" and types[300] == gguf.TokenType.UNUSED


def test_chat_template_is_carried_when_the_checkpoint_has_one(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(BUNDLED, ck)
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    (ck / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": EOT}))
    assert read(export(ck, tmp_path / "a.gguf"))[0]["tokenizer.chat_template"] == template
    (ck / "chat_template.jinja").write_text("{{ messages[0].content }}")  # the file wins, as in model/chat_template
    assert read(export(ck, tmp_path / "b.gguf"))[0]["tokenizer.chat_template"] == "{{ messages[0].content }}"
    (ck / "chat_template.jinja").write_text("{% for m in %}")  # one the server could not load is not exported
    with pytest.raises(ExportError, match="chat template"):
        export(ck, tmp_path / "c.gguf")
    assert not (tmp_path / "c.gguf").exists()


def test_a_chat_fine_tunes_end_of_turn_token_is_declared(tmp_path):
    """A ChatML-style checkpoint (its own <|im_end|> ends a turn, generation_config.json stops there) exports it
    as llama.cpp's end-of-turn token; a checkpoint whose turns end at <|endoftext|> declares none."""
    from model.chat_template import ChatTemplate, chat_config_files
    from model.special_tokens import add_special_tokens

    base = load_checkpoint(BUNDLED)
    tok = add_special_tokens(base.model, base.tokenizer, ["<|im_start|>", "<|im_end|>"])
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    im_end = tok.special_tokens["<|im_end|>"]
    files = chat_config_files(ChatTemplate(chatml, "chatml", eos_token=EOT), [tok.eot_id, im_end])
    ck = save_checkpoint(tmp_path / "ck", base.model, tok, {}, tokenizer_file=BUNDLED / "shakespeare.tiktoken",
                         extra_files=files)
    fields = read(export(ck, tmp_path / "a.gguf"))[0]
    assert fields["tokenizer.ggml.eot_token_id"] == im_end and fields["tokenizer.chat_template"] == chatml
    assert fields["tokenizer.ggml.tokens"][im_end] == "<|im_end|>"
    files = chat_config_files(ChatTemplate(chatml, "chatml", eos_token=EOT), [tok.eot_id])
    ck = save_checkpoint(tmp_path / "ck2", base.model, tok, {}, tokenizer_file=BUNDLED / "shakespeare.tiktoken",
                         extra_files=files)
    assert "tokenizer.ggml.eot_token_id" not in read(export(ck, tmp_path / "b.gguf"))[0]


@pytest.mark.parametrize("field, value", [("norm", "post"), ("activation", "relu")])
def test_unrepresentable_configs_are_refused_in_one_line(tmp_path, capsys, field, value):
    tok = Tokenizer.from_ranks_file(write_byte_ranks(tmp_path / "bytes.tiktoken"))
    ck = save_checkpoint(tmp_path / "ck", tiny_model(**{field: value}), tok, tokenizer_file=tmp_path / "bytes.tiktoken")
    out = tmp_path / "x.gguf"
    assert main(["--checkpoint", str(ck), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {field}={value!r} cannot be exported to GGUF"), err
    assert not out.exists() and not list(tmp_path.glob(".x.gguf*"))


def test_missing_and_corrupt_checkpoints_are_one_line_without_traceback(tmp_path):
    def run(ck: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "model.export_gguf", "--checkpoint", str(ck), "--out",
                               str(tmp_path / "x.gguf")], cwd=REPO, capture_output=True, text=True)

    r = run(tmp_path / "nope")
    assert r.returncode == 2 and r.stderr == f"error: {tmp_path / 'nope'}: checkpoint directory not found\n"
    ck = tmp_path / "ck"
    shutil.copytree(BUNDLED, ck)
    (ck / "model.safetensors").write_bytes((BUNDLED / "model.safetensors").read_bytes()[:1000])
    r = run(ck)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "truncated or corrupt" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x.gguf").exists()


# ------------------------------------------------------------------ llama.cpp itself (slow: builds it once)


def llama_tools() -> Path:
    """llama.cpp's build dir of bench/peer_setup.py (built there, with llama-tokenize and llama-server, if missing)."""
    from bench.common import CACHE
    from bench.peer_setup import llama_binary, setup_llama_server

    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:  # the one reason to skip; any other set-up error (a failed download or build) fails the test
        pytest.skip(f"building llama.cpp needs {' and '.join(missing)} (apt-get install cmake g++)")
    peers = CACHE / "peers"
    setup_llama_server(peers, jobs=os.cpu_count() or 2)
    return llama_binary(peers, "llama-server").parent


def llama_tokenize(bin_dir: Path, gguf_file: Path, text: str) -> list[int]:
    r = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", str(gguf_file), "-p", text, "--ids", "--log-disable",
                        "--no-parse-special"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_server_greedy(bin_dir: Path, gguf_file: Path, prompt: list[int], n: int, log: Path) -> list[int]:
    import httpx

    from bench.harness import Server, free_port

    port = free_port()
    server = Server("llama", [str(bin_dir / "llama-server"), "-m", str(gguf_file), "--host", "127.0.0.1", "--port",
                              str(port), "-t", "2", "-c", "512", "-np", "1", "--no-webui"], {}, log, port)
    server.start()
    try:
        server.wait_ready(300)
        r = httpx.post(server.url + "/completion", json={
            "prompt": prompt, "n_predict": n, "temperature": 0.0, "return_tokens": True, "cache_prompt": False,
            "ignore_eos": True}, timeout=300)
        r.raise_for_status()
        return list(r.json()["tokens"])
    finally:
        server.stop()


def our_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens by full recompute, and the top-1 − top-2 logit margin at each step."""
    ids, margins = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            top = torch.topk(model(torch.tensor([ids]))[0][0, -1].float(), 2)
            ids.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
    return ids[len(prompt):], margins


@pytest.mark.slow
@pytest.mark.timeout(7200)  # a first run builds llama.cpp (~15 min on 2 cores)
@pytest.mark.parametrize("which", ["bundled", "imported-gpt2"])
def test_llama_cpp_tokenizes_and_decodes_like_ours(request, tmp_path, which):
    bin_dir = llama_tools()
    if which == "bundled":
        ck_dir, gguf_file = BUNDLED, export(BUNDLED, tmp_path / "shakespeare-f32.gguf", "f32")
    else:
        ck_dir, gguf_file = request.getfixturevalue("imported_gpt2")
    ck = load_checkpoint(ck_dir)
    texts = TEXTS + ([SHARED_DATA.read_text(encoding="utf-8")[-4000:]] if SHARED_DATA.is_file() else [])
    for text in texts:
        assert llama_tokenize(bin_dir, gguf_file, text) == ck.tokenizer.encode(text, allow_special=False), text[:60]

    prompt = ck.tokenizer.encode(TEXTS[0])
    n = min(64, ck.config.block_size - len(prompt))
    ours, margins = our_greedy(ck.model, prompt, n)
    t = time.monotonic()
    theirs = llama_server_greedy(bin_dir, gguf_file, prompt, n, tmp_path / "llama-server.log")
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert theirs == ours, (f"llama-server's greedy tokens differ from ours at {first} of {n} "
                            f"(our top-1 − top-2 logit margin there: {margins[first] if first is not None else '-'}; "
                            f"smallest margin {min(margins):.4g}; {time.monotonic() - t:.0f} s)")
