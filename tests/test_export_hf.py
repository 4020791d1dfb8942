"""Export to Hugging Face transformers: the exported directory loads there and computes our logits and token ids."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import pytest
import torch

from model.checkpoint import load_checkpoint, save_checkpoint
from model.convert_hf import convert, convert_state, hf_config_to_ours, load_hf_state
from model.export_hf import export, main
from model.tokenizer import Tokenizer
from tests.helpers import REPO, tiny_model, write_byte_ranks

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEXTS = [
    "Hello, world! It's 3 o'clock; we'll see.",
    "  leading and trailing spaces   ",
    "tabs\tand\nnew\n\n\nlines \n\r\n",
    "unicode: café naïve Ωμέγα 東京 日本語 🙂👍🏽 z̧ ¿qué?",
    "text<|endoftext|>after the special token",
    "",
    "1234567 numbers 3.14159 and    many     spaces",
    "'s 're 've 'll don't I'M",
]
SHAKESPEARE = [
    "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father and refuse thy name;\n",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n",
]


def corpus(n_lines: int = 300, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["the", "king", "queen", "thou", "art", "café", "naïve", "東京", "🙂", "don't", "we'll", "1999",
             "Romeo", "speak", "hear", "me", "and", "of", "to", "Ωμέγα"]
    lines = [" ".join(rng.choices(words, k=rng.randint(3, 10))) + rng.choice([".", "!", "?", ",\t", ":  "])
             for _ in range(n_lines)]
    return "\n".join(lines) + "\n"


def hf_load(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return model, transformers.AutoTokenizer.from_pretrained(path)


def max_logit_diff(ours, hf_model, ids: list[int] | torch.Tensor) -> float:
    x = torch.as_tensor(ids)
    x = x[None] if x.dim() == 1 else x
    with torch.no_grad():
        return (ours(x)[0] - hf_model(x).logits).abs().max().item()


def assert_same_tokens(tokenizer: Tokenizer, hf_tok, tok_json, texts: list[str]) -> None:
    for text in texts:
        ids = tokenizer.encode(text)
        assert hf_tok(text)["input_ids"] == ids, text
        assert tok_json.encode(text).ids == ids, text
        assert hf_tok.decode(ids) == text


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "model.export_hf", *args], cwd=REPO, capture_output=True, text=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A random tiny model (vocab 512) with a trained 320-token byte-level BPE: the vocabulary is padded."""
    from training.tokenizer import save_ranks, train_bpe

    tmp = tmp_path_factory.mktemp("trained")
    ranks_file = tmp / "tok.tiktoken"
    save_ranks(train_bpe([corpus()], vocab_size=320), ranks_file)
    tokenizer = Tokenizer.from_ranks_file(ranks_file)
    assert tokenizer.vocab_size == 320
    ck = save_checkpoint(tmp / "ck", tiny_model(seed=3), tokenizer, tokenizer_file=ranks_file)
    out = tmp / "hf"
    assert main(["--checkpoint", str(ck), "--out", str(out)]) == 0
    return load_checkpoint(ck), out


def test_trained_tokenizer_checkpoint_through_transformers(trained):
    ck, out = trained
    hf_model, hf_tok = hf_load(out)
    assert isinstance(hf_model, transformers.GPT2LMHeadModel)
    x = torch.randint(0, ck.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    assert max_logit_diff(ck.model, hf_model, x) <= 1e-4
    for text in TEXTS + [corpus(5, seed=9)]:
        ids = ck.tokenizer.encode(text)[: ck.config.block_size]
        if ids:
            assert max_logit_diff(ck.model, hf_model, ids) <= 1e-4
    assert_same_tokens(ck.tokenizer, hf_tok, tokenizers.Tokenizer.from_file(str(out / "tokenizer.json")),
                       TEXTS + [corpus(20, seed=1)])
    assert hf_tok.eos_token == hf_tok.bos_token == "<|endoftext|>"
    assert hf_tok.eos_token_id == ck.tokenizer.eot_id == 319


def test_padded_vocab_keeps_the_model_size(trained):
    ck, out = trained
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == ck.config.vocab_size == 512
    assert config["eos_token_id"] == 319 and config["n_positions"] == ck.config.block_size
    vocab = json.loads((out / "vocab.json").read_text())
    assert sorted(vocab.values()) == list(range(320))
    merges = (out / "merges.txt").read_text().splitlines()
    assert merges[0].startswith("#version") and len(merges) - 1 >= 320 - 1 - 256  # a merge per token at least


def test_round_trip_gives_identical_weights(trained):
    ck, out = trained
    back = convert_state(load_hf_state(out))
    config = hf_config_to_ours(json.loads((out / "config.json").read_text()))
    assert config == dataclasses.replace(ck.config, dropout=0.0)
    ours = {k: v for k, v in ck.model.state_dict().items() if k != "lm_head.weight"}
    assert back.keys() == ours.keys()
    for k, v in ours.items():
        assert torch.equal(back[k], v), k


def test_shakespeare_checkpoint(tmp_path):
    ck = load_checkpoint(REPO / "checkpoints" / "shakespeare")
    out = export(ck.path, tmp_path / "hf")
    hf_model, hf_tok = hf_load(out)
    diffs = [max_logit_diff(ck.model, hf_model, ck.tokenizer.encode(text)) for text in SHAKESPEARE]
    assert max(diffs) <= 1e-4, diffs
    assert_same_tokens(ck.tokenizer, hf_tok, tokenizers.Tokenizer.from_file(str(out / "tokenizer.json")),
                       SHAKESPEARE + TEXTS)
    prompt = ck.tokenizer.encode("ROMEO:\n")
    with torch.no_grad():
        logits = ck.model(torch.tensor([prompt]))[0][0, -1]
        ref = hf_model(torch.tensor([prompt])).logits[0, -1]
    assert logits.argmax() == ref.argmax()


def test_r50k_checkpoint(tmp_path, gpt2_tokenizer):
    """GPT-2's tokenizer files tokenize like tiktoken; export then import is the identity."""
    model = tiny_model(seed=5, vocab_size=50257)
    ck = save_checkpoint(tmp_path / "ck", model, gpt2_tokenizer)
    out = export(ck, tmp_path / "hf")
    hf_model, hf_tok = hf_load(out)
    text = " ".join(TEXTS) + (REPO / "docs" / "training.md").read_text()[:4000]
    assert_same_tokens(gpt2_tokenizer, hf_tok, tokenizers.Tokenizer.from_file(str(out / "tokenizer.json")),
                       TEXTS + [text])
    assert hf_tok("Hello world")["input_ids"] == [15496, 995]  # GPT-2's ids
    assert len(hf_tok) == 50257 and hf_tok.eos_token_id == 50256
    assert max_logit_diff(model, hf_model, gpt2_tokenizer.encode(TEXTS[3])) <= 1e-4
    back = load_checkpoint(convert(out, tmp_path / "back"))
    assert back.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(back.model.state_dict()[k], v), k


def test_relu_exports(tmp_path, byte_tokenizer):
    model = tiny_model(seed=7, activation="relu")
    ck = save_checkpoint(tmp_path / "ck", model, byte_tokenizer, tokenizer_file=tmp_path / "bytes.tiktoken")
    out = export(ck, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["activation_function"] == "relu"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(2))
    assert max_logit_diff(model, hf_model, x) <= 1e-4


@pytest.mark.parametrize("override, field", [({"norm": "post"}, "norm"), ({"position": "sinusoidal"}, "position"),
                                             ({"bias": False}, "bias")])
def test_refused_variants(tmp_path, capsys, override, field):
    ranks = write_byte_ranks(tmp_path / "b.tiktoken")
    ck = save_checkpoint(tmp_path / "ck", tiny_model(**override), Tokenizer.from_ranks_file(ranks),
                         tokenizer_file=ranks)
    assert main(["--checkpoint", str(ck), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and f"{field}=" in err, err
    assert not (tmp_path / "hf").exists()


def test_cli_errors_are_one_line(tmp_path):
    ranks = write_byte_ranks(tmp_path / "b.tiktoken")
    ck = save_checkpoint(tmp_path / "ck", tiny_model(norm="post"), Tokenizer.from_ranks_file(ranks),
                         tokenizer_file=ranks)
    r = run("--checkpoint", str(ck), "--out", str(tmp_path / "hf"))
    assert r.returncode != 0 and "norm='post'" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert main(["--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "hf")]) == 2
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
