"""Imported GPT-2 weights against Hugging Face transformers (the reference implementation)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.generate import generate
from engine.params import SamplingParams
from model.checkpoint import load_checkpoint
from tests.helpers import REPO

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=50257)
    model = transformers.GPT2LMHeadModel(config).eval()
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory, gpt2_tokenizer):
    out = tmp_path_factory.mktemp("ours") / "gpt2-tiny"
    r = subprocess.run([sys.executable, "-m", "model.convert_hf", "--hf-dir", str(hf_model[1]), "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return load_checkpoint(out)


def test_logits_match_transformers(hf_model, converted):
    x = torch.randint(0, 50257, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model[0](x).logits
        ours, _ = converted.model(x)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_greedy_continuation_matches_transformers(hf_model, converted):
    prompt = converted.tokenizer.encode("The meaning of life is")
    with torch.no_grad():
        ref = hf_model[0].generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    ours = generate(converted.model, converted.tokenizer, [prompt],
                    SamplingParams(max_new_tokens=20, temperature=0, stop_at_eos=False))[0].tokens
    assert ours == ref


def test_pytorch_bin_and_errors(hf_model, tmp_path, gpt2_tokenizer):  # the checkpoint loads GPT-2's ranks
    model, _ = hf_model
    bin_dir = tmp_path / "bin"
    model.save_pretrained(bin_dir)
    # an older checkpoint's pytorch_model.bin (a torch.save'd state dict), written here: transformers 5 writes
    # only safetensors
    (bin_dir / "model.safetensors").unlink()
    torch.save(model.state_dict(), bin_dir / "pytorch_model.bin")
    from model.convert_hf import convert

    ck = load_checkpoint(convert(bin_dir, tmp_path / "from-bin"))
    x = torch.randint(0, 50257, (1, 10))
    with torch.no_grad():
        assert (ck.model(x)[0] - model(x).logits).abs().max() <= 1e-4
    r = subprocess.run([sys.executable, "-m", "model.convert_hf", "--hf-dir", str(tmp_path / "none"),
                        "--out", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2 and "no config.json" in r.stderr and "Traceback" not in r.stderr
