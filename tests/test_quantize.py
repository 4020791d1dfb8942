"""Quantized checkpoints (model/quantize.py): saved once, loaded like any checkpoint, equal to quantizing at load,
and refused in one line when a tensor is missing or the format asked for differs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import model.linear as L
from model.checkpoint import CheckpointError, load_checkpoint
from model.quantize import main

BUNDLED = Path(__file__).resolve().parents[1] / "checkpoints" / "shakespeare"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("q")
    for mode in ("int8", "int4"):
        assert main(["--checkpoint", str(BUNDLED), "--out", str(d / mode), "--mode", mode, "--group-size", "32"]) == 0
    return d


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_saved_checkpoint_equals_quantizing_at_load(saved, mode):
    assert json.loads((saved / mode / "quantization.json").read_text())["mode"] == mode
    assert (saved / mode / "model.safetensors").stat().st_size < (BUNDLED / "model.safetensors").stat().st_size / 3
    ck = load_checkpoint(saved / mode)
    ref = load_checkpoint(BUNDLED)
    L.convert(ref.model, mode, 32)
    assert L.quantized_format(ck.model) == mode
    idx = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(ck.model(idx)[0], ref.model(idx)[0], atol=0, rtol=0)
    assert L.convert(ck.model, "none")["format"] == mode  # served as stored
    with pytest.raises(L.FormatError, match=f"stored as {mode}"):
        L.convert(ck.model, "int4" if mode == "int8" else "int8")
    ck.model.pad_vocab(2048 + 64)  # the server's padding works on the int8 table too
    with torch.inference_mode():
        assert ck.model(idx)[0].shape[-1] == 2048 + 64


def test_a_missing_scale_or_a_bad_mode_is_one_line(saved, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in (saved / "int8").iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    state = load_file(str(bad / "model.safetensors"))
    del state["transformer.h.1.mlp.c_fc.weight_scale"]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: quantized as int8 \(quantization\.json\) but "
                                              r"missing tensor transformer\.h\.1\.mlp\.c_fc\.weight_scale"):
        load_checkpoint(bad)
    (bad / "quantization.json").write_text('{"mode": "int3"}')
    with pytest.raises(CheckpointError, match="quantization.json: mode must be int8 or int4"):
        load_checkpoint(bad)


def test_cli_errors_are_one_line(saved, tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o"), "--mode", "int8"]) == 2
    assert main(["--checkpoint", str(saved / "int8"), "--out", str(tmp_path / "o"), "--mode", "int4"]) == 2
    assert main(["--checkpoint", str(BUNDLED), "--out", str(saved / "int8"), "--mode", "int8"]) == 2
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in BUNDLED.iterdir():
        (corrupt / f.name).write_bytes(b"not safetensors" if f.name == "model.safetensors" else f.read_bytes())
    assert main(["--checkpoint", str(corrupt), "--out", str(tmp_path / "o"), "--mode", "int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("python -m model.quantize: error: ") for line in err)
    assert "already quantized" in err[1] and "already exists" in err[2] and "corrupt safetensors" in err[3]
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.tmp").exists()
