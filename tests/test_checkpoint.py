"""Checkpoint round trip and every fault named at load time."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tests.helpers import tiny_model


@pytest.fixture
def ckpt(tmp_path, byte_tokenizer):
    model = tiny_model(vocab_size=264, position="sinusoidal")
    src = tmp_path / "bytes.tiktoken"  # written by the byte_tokenizer fixture
    return save_checkpoint(tmp_path / "ck", model, byte_tokenizer, {"step": 5, "val_loss": 2.5},
                           tokenizer_file=src), model


def test_round_trip(ckpt):
    path, model = ckpt
    loaded = load_checkpoint(path)
    x = torch.randint(0, 264, (2, 9))
    torch.testing.assert_close(loaded.model(x)[0], model(x)[0], rtol=0, atol=0)
    assert loaded.metadata["step"] == 5 and loaded.tokenizer.encode("the") == [259]
    assert loaded.model.lm_head.weight is loaded.model.transformer.wte.weight
    assert sorted(p.name for p in path.iterdir()) == [
        "bytes.tiktoken", "config.json", "metadata.json", "model.safetensors", "tokenizer.json"]


def test_overwrite_is_atomic_replacement(ckpt, byte_tokenizer, tmp_path):
    path, model = ckpt
    save_checkpoint(path, model, byte_tokenizer, {"step": 6}, tokenizer_file=tmp_path / "bytes.tiktoken")
    assert load_checkpoint(path).metadata["step"] == 6
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


def _expect(path, match):
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)


def test_missing_directory_and_files(ckpt, tmp_path):
    path, _ = ckpt
    _expect(tmp_path / "nope", r"nope: checkpoint directory not found")
    (path / "model.safetensors").unlink()
    _expect(path, r"model\.safetensors: missing file")
    (path / "config.json").unlink()
    _expect(path, r"config\.json: missing file")


def test_truncated_and_corrupt_weights(ckpt):
    path, _ = ckpt
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    _expect(path, r"model\.safetensors: truncated or corrupt")
    (path / "model.safetensors").write_bytes(b"\x00" * 64)
    _expect(path, r"model\.safetensors: truncated or corrupt")


def test_shapes_that_disagree_with_config(ckpt):
    path, _ = ckpt
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "n_embd": 64}))
    _expect(path, r"model\.safetensors: does not match config\.json: tensor .* has shape")
    (path / "config.json").write_text(json.dumps({**cfg, "n_layer": 3}))
    _expect(path, r"missing tensor transformer\.h\.2")
    (path / "config.json").write_text(json.dumps({**cfg, "n_layers": 3}))
    _expect(path, r"config\.json: unknown GPTConfig keys")
    (path / "config.json").write_text("{not json")
    _expect(path, r"config\.json: not valid JSON")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_weights(ckpt, value):
    path, _ = ckpt
    state = load_file(str(path / "model.safetensors"))
    state["transformer.ln_f.weight"][3] = value
    save_file(state, str(path / "model.safetensors"))
    _expect(path, r"non-finite values .*ln_f")


def test_unknown_or_broken_tokenizer(ckpt, gpt2_tokenizer):
    path, _ = ckpt
    (path / "tokenizer.json").write_text(json.dumps({"type": "tiktoken", "name": "klingon"}))
    _expect(path, r"tokenizer\.json: unknown tokenizer 'klingon'")
    (path / "tokenizer.json").write_text(json.dumps({"type": "tiktoken_file", "file": "gone.tiktoken"}))
    _expect(path, r"tokenizer\.json: .*gone\.tiktoken: tokenizer ranks file not found")
    (path / "tokenizer.json").write_text(json.dumps({"type": "tiktoken", "name": "r50k_base"}))
    _expect(path, r"tokenizer has 50257 tokens but the model's vocab_size is 264")
