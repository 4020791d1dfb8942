"""model/task_head.py: the task tokens and new embedding rows, each kind's input encoding (truncation included),
the head on the [Extract] state, predict, and the task files of a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from engine.generate import SamplingParams, generate
from model.checkpoint import load_checkpoint
from model.task_head import (
    DELIM,
    EXTRACT,
    HEAD_FILE,
    KINDS,
    START,
    TASK_FILE,
    Task,
    TaskError,
    add_task_tokens,
    encode_item,
    load_task,
    make_batch,
    special_ids,
    task_logits,
)
from tests.helpers import tiny_model
from tests.task_fixtures import write_task_checkpoint

ITEMS = {
    "classification": ["the theme", {"text": "other"}],
    "entailment": [["the", "theme"], {"premise": "a", "hypothesis": "b"}, {"text_a": "x", "text_b": "y"}],
    "similarity": [("the", "theme"), {"text_a": "x", "text_b": "y"}],
    "multiple_choice": [{"context": "the", "answers": ["a", "bb", "ccc"]}, {"context": "x", "answers": ["y", "z"]}],
}


@pytest.fixture
def task_tok(byte_tokenizer):
    model = tiny_model(seed=0, vocab_size=byte_tokenizer.vocab_size, block_size=16)
    return model, add_task_tokens(model, byte_tokenizer, torch.Generator().manual_seed(0))


def test_task_tokens_get_new_ids_and_embedding_rows(byte_tokenizer):
    model = tiny_model(seed=0, vocab_size=byte_tokenizer.vocab_size)
    before = model.transformer.wte.weight.detach().clone()
    tok = add_task_tokens(model, byte_tokenizer)
    n = byte_tokenizer.vocab_size
    assert special_ids(tok) == (n, n + 1, n + 2) and tok.vocab_size == n + 3
    assert model.config.vocab_size == n + 3 and model.transformer.wte.weight.shape[0] == n + 3
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    w = model.transformer.wte.weight.detach()
    assert torch.equal(w[:n], before)  # the old rows are untouched
    new = w[n:]
    assert torch.allclose(new.mean(0), before.mean(0), atol=0.05)  # mean of the old rows + N(0, 0.02²)
    assert not torch.equal(new[0], new[1]) and (new - before.mean(0)).abs().max() < 0.2
    logits, _ = model(torch.tensor([[n, 5, n + 2]]))
    assert logits.shape == (1, 3, n + 3)
    # text never encodes to them; ids decode to their names
    assert tok.encode(f"{START}x{EXTRACT}") == byte_tokenizer.encode(f"{START}x{EXTRACT}")
    assert tok.decode([n, ord("x"), n + 2]) == f"{START}x{EXTRACT}"
    # adding them again changes nothing
    assert add_task_tokens(model, tok).special_tokens == tok.special_tokens and model.config.vocab_size == n + 3


def test_hidden_is_what_the_output_head_reads():
    model = tiny_model(seed=1)
    idx = torch.randint(0, 512, (2, 9))
    logits, _ = model(idx)
    h = model.hidden(idx)
    assert h.shape == (2, 9, 32)
    assert torch.allclose(h @ model.lm_head.weight.T, logits, atol=1e-5)


def test_encodings_of_each_kind(task_tok):
    _, tok = task_tok
    s, d, e = special_ids(tok)
    enc = lambda t: tok.encode(t, allow_special=False)  # noqa: E731
    assert encode_item("classification", tok, "the theme", 64) == [[s, *enc("the theme"), e]]
    assert encode_item("entailment", tok, {"premise": "ab", "hypothesis": "c"}, 64) == [
        [s, *enc("ab"), d, *enc("c"), e]]
    assert encode_item("similarity", tok, ["ab", "c"], 64) == [[s, *enc("ab"), d, *enc("c"), e],
                                                               [s, *enc("c"), d, *enc("ab"), e]]
    assert encode_item("multiple_choice", tok, {"context": "x", "answers": ["a", "b"]}, 64) == [
        [s, *enc("x"), d, *enc("a"), e], [s, *enc("x"), d, *enc("b"), e]]
    # <|endoftext|> and the task tokens written in text stay text
    assert encode_item("classification", tok, "<|endoftext|>[Start]", 64)[0][1:-1] == enc("<|endoftext|>[Start]")


def test_long_inputs_lose_their_beginning_and_keep_the_special_tokens(task_tok):
    _, tok = task_tok
    s, d, e = special_ids(tok)
    assert encode_item("classification", tok, "abcdefghij", 6) == [[s, *b"ghij", e]]
    # the first text is cut first (from the left), then the second
    assert encode_item("entailment", tok, ["abcdef", "xyz"], 8) == [[s, *b"ef", d, *b"xyz", e]]
    assert encode_item("entailment", tok, ["abcdef", "uvwxyz"], 6) == [[s, d, *b"xyz", e]]
    # similarity: both orders hold the same cut texts
    a, b = encode_item("similarity", tok, ["abcdef", "xyz"], 8)
    assert a == [s, *b"ef", d, *b"xyz", e] and b == [s, *b"xyz", d, *b"ef", e]
    seqs = encode_item("multiple_choice", tok, {"context": "abcdef", "answers": ["x", "xyz"]}, 8)
    assert seqs == [[s, *b"cdef", d, *b"x", e], [s, *b"ef", d, *b"xyz", e]]
    assert all(len(q) <= 8 for q in seqs)
    with pytest.raises(TaskError, match="too small"):
        encode_item("entailment", tok, ["a", "b"], 2)


def test_batch_padding_and_lm_targets(task_tok):
    _, tok = task_tok
    special = special_ids(tok)
    s, d, e = special
    batch = make_batch([[[s, 1, 2, e]], [[s, 3, d, 4, 5, e]]], special)
    assert batch.idx.shape == (2, 6) and batch.extract.tolist() == [3, 5] and batch.n_seqs == [1, 1]
    assert batch.targets.tolist() == [[1, 2, -1, -1, -1, -1], [3, -1, 4, 5, -1, -1]]  # text tokens only


def test_logits_read_the_extract_state_and_padding_changes_nothing(task_tok):
    model, tok = task_tok
    special = special_ids(tok)
    head = Task.create("classification", ["a", "b", "c"], 32).head.eval()
    one = encode_item("classification", tok, "the", 16)
    two = encode_item("classification", tok, "the theme is", 16)
    alone, _ = task_logits(model, head, "classification", make_batch([one], special))
    padded, _ = task_logits(model, head, "classification", make_batch([one, two], special))
    assert torch.allclose(alone[0], padded[0], atol=1e-5)
    h = model.hidden(torch.tensor(one))[0, -1]
    assert torch.allclose(alone[0], head.weight @ h + head.bias, atol=1e-5)


def test_similarity_adds_both_orders_and_choice_is_a_softmax_over_answers(task_tok):
    model, tok = task_tok
    special = special_ids(tok)
    sim = Task.create("similarity", ["same", "different"], 32).head.eval()
    seqs = encode_item("similarity", tok, ["ab", "cde"], 16)
    logits, _ = task_logits(model, sim, "similarity", make_batch([seqs], special))
    h = sum(model.hidden(torch.tensor([q]))[0, -1] for q in seqs)
    assert torch.allclose(logits[0], sim.weight @ h + sim.bias, atol=1e-5)
    swapped, _ = task_logits(model, sim, "similarity", make_batch([encode_item("similarity", tok, ["cde", "ab"], 16)],
                                                                  special))
    assert torch.allclose(logits, swapped, atol=1e-5)  # order-free

    mc = Task.create("multiple_choice", [], 32).head.eval()
    items = [encode_item("multiple_choice", tok, it, 16) for it in ITEMS["multiple_choice"]]
    scores, lm = task_logits(model, mc, "multiple_choice", make_batch(items, special), lm=True)
    assert scores.shape == (2, 3) and scores[1, 2] == float("-inf") and torch.isfinite(scores[0]).all()
    single = [task_logits(model, mc, "multiple_choice", make_batch([[q]], special))[0][0, 0] for q in items[0]]
    assert torch.allclose(scores[0], torch.stack(single), atol=1e-5)
    assert lm is not None and lm.item() > 0


@pytest.mark.parametrize("kind", KINDS)
def test_predict_shapes_for_each_kind(tmp_path, kind):
    labels = ("x", "y", "z")
    ck_dir = write_task_checkpoint(tmp_path / kind, kind, labels)
    ck = load_checkpoint(ck_dir)
    task = load_task(ck_dir, ck.model)
    assert task.kind == kind and task.labels == ([] if kind == "multiple_choice" else list(labels))
    items = ITEMS[kind]
    out = task.predict(ck.model, ck.tokenizer, items)
    assert len(out) == len(items)
    for item, probs in zip(items, out):
        keys = [str(i) for i in range(len(item["answers"]))] if kind == "multiple_choice" else list(labels)
        assert list(probs) == keys
        assert sum(probs.values()) == pytest.approx(1.0, abs=1e-5) and all(0 <= p <= 1 for p in probs.values())
    # one item alone gives the same probabilities as in a batch
    assert task.predict(ck.model, ck.tokenizer, items[-1:])[0] == pytest.approx(out[-1], abs=1e-5)
    # inputs longer than the context are cut, not refused
    long = {"classification": "the " * 100, "entailment": ["a " * 50, "b " * 50], "similarity": ["a " * 50, "b"],
            "multiple_choice": {"context": "c " * 80, "answers": ["a " * 80, "b"]}}[kind]
    assert len(task.predict(ck.model, ck.tokenizer, [long])) == 1


@pytest.mark.parametrize("kind,item,message", [
    ("classification", 3, "expected a string, got int"),
    ("classification", {"txt": "a"}, "got keys ['txt']"),
    ("entailment", ["a"], "a pair of strings, got a list of 1"),
    ("entailment", {"premise": "a"}, '{"premise", "hypothesis"} or {"text_a", "text_b"}'),
    ("similarity", ["a", 2], "the second text must be a string"),
    ("multiple_choice", {"context": "a", "answers": ["x"]}, "at least 2"),
    ("multiple_choice", "a", 'expected {"context": ..., "answers": [...]}'),
    ("multiple_choice", {"context": "a", "answers": ["x", 1]}, "answers[1] must be a string"),
])
def test_validate_item_says_what_is_wrong_in_one_line(kind, item, message):
    task = Task.create(kind, ["a", "b"], 8)
    err = task.validate_item(item)
    assert err is not None and message in err and "\n" not in err
    assert all(task.validate_item(ok) is None for ok in ITEMS[kind])
    with pytest.raises(TaskError, match="item 0"):
        task.predict(tiny_model(), None, [item])


def test_fine_tuned_checkpoint_is_a_normal_one_that_generates(tmp_path):
    ck_dir = write_task_checkpoint(tmp_path / "ck", "entailment", ["yes", "no"])
    assert (ck_dir / TASK_FILE).is_file() and (ck_dir / HEAD_FILE).is_file()
    ck = load_checkpoint(ck_dir)
    assert ck.tokenizer.special_tokens[DELIM] == ck.tokenizer.eot_id + 2  # the task tokens survive save/load
    assert ck.config.vocab_size == ck.tokenizer.vocab_size
    seq = generate(ck.model, ck.tokenizer, [ck.tokenizer.encode("the")], SamplingParams(max_new_tokens=8, seed=1))[0]
    assert len(seq.tokens) >= 1 and isinstance(seq.text, str)


def test_load_task_without_a_head_is_none(tmp_path, byte_tokenizer):
    from model.checkpoint import save_checkpoint

    ck_dir = save_checkpoint(tmp_path / "plain", tiny_model(vocab_size=byte_tokenizer.vocab_size), byte_tokenizer,
                             tokenizer_file=tmp_path / "bytes.tiktoken")
    assert load_task(ck_dir, load_checkpoint(ck_dir).model) is None


def test_load_task_names_the_broken_file(tmp_path):
    ck_dir = write_task_checkpoint(tmp_path / "ck", "classification", ["a", "b"])
    model = load_checkpoint(ck_dir).model

    def err() -> str:
        with pytest.raises(TaskError) as e:
            load_task(ck_dir, model)
        assert "\n" not in str(e.value)
        return str(e.value)

    head = (ck_dir / HEAD_FILE).read_bytes()
    (ck_dir / HEAD_FILE).write_bytes(head[:50])
    assert HEAD_FILE in err() and "corrupt" in err()
    save_file({"weight": torch.zeros(3, 32), "bias": torch.zeros(3)}, str(ck_dir / HEAD_FILE))
    assert "weight has shape (3, 32), expected (2, 32)" in err()
    save_file({"weight": torch.full((2, 32), float("nan")), "bias": torch.zeros(2)}, str(ck_dir / HEAD_FILE))
    assert "not finite" in err()
    (ck_dir / HEAD_FILE).write_bytes(head)
    assert load_task(ck_dir, model) is not None
    meta = json.loads((ck_dir / TASK_FILE).read_text())
    (ck_dir / TASK_FILE).write_text(json.dumps({**meta, "kind": "regression"}))
    assert TASK_FILE in err() and "kind must be one of" in err()
    (ck_dir / TASK_FILE).write_text("{nope")
    assert "not valid JSON" in err()
    (ck_dir / TASK_FILE).unlink()
    assert "task.json: missing" in err()
    # a head that does not fit the model (another n_embd)
    (ck_dir / TASK_FILE).write_text(json.dumps(meta))
    other = tiny_model(n_embd=16, n_head=2, vocab_size=model.config.vocab_size)
    with pytest.raises(TaskError, match="expected \\(2, 16\\)"):
        load_task(ck_dir, other)
    # the tokenizer must list the task tokens
    tok = json.loads((ck_dir / "tokenizer.json").read_text())
    (ck_dir / "tokenizer.json").write_text(json.dumps({k: v for k, v in tok.items() if k != "special_tokens"}))
    assert "tokenizer.json" in err() and START in err()
