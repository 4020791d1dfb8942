"""Chat fine-tuning (training/finetune.py --task chat: training/chat/: finetune.py, data.py, encoding.py,
loop.py): the loss mask (assistant tokens with weight 1 only), bad data as one line naming FILE:LINE,
over-long conversations dropped or truncated and counted, exact resume mid-epoch, and a few-step fine-tune whose
checkpoint carries its template and stop tokens into the server and through model.export_hf to transformers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from model.chat_template import SFT_TEMPLATE, ChatTemplate, end_of_turn, load_chat_template, template_special_tokens
from model.checkpoint import TRAINING_STATE, load_checkpoint, save_checkpoint
from model.special_tokens import add_special_tokens
from model.tokenizer import EOT, Tokenizer
from tests.helpers import tiny_model, write_byte_ranks
from tests.task_fixtures import one_line_error, write_jsonl
from training.chat.data import ChatDataError, TokenDir, chat_batch, encode_chat_file, pack_row, parse_conversation
from training.chat.encoding import ChatEncoder, Message

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = ["learning_rate=3e-3", "min_lr=3e-4", "warmup_iters=3", "batch_size=8", "log_interval=1", "num_threads=1",
        "dropout=0.0", "eval_interval=4"]
WORDS = "apple bread cloud dance eagle fable grape hotel".split()
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def sets(*items: str) -> list[str]:
    return [x for item in (*TINY, *items) for x in ("--set", item)]


def echo_lines(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        w = rng.choice(WORDS)
        out.append({"messages": [{"role": "system", "content": "Echo in capitals."}, {"role": "user", "content": w},
                                 {"role": "assistant", "content": w.upper()}]})
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("chat")
    ranks = write_byte_ranks(d / "bytes.tiktoken", [b"th", b"he"])
    tok = Tokenizer.from_ranks_file(ranks)
    base = save_checkpoint(d / "base", tiny_model(seed=0, vocab_size=tok.vocab_size, block_size=64), tok,
                           tokenizer_file=ranks)
    return {"base": base, "ranks": ranks, "train": write_jsonl(d / "train.jsonl", echo_lines(120, 1)),
            "val": write_jsonl(d / "val.jsonl", echo_lines(24, 2))}


@pytest.fixture(scope="module")
def chat_tok(files) -> Tokenizer:
    return Tokenizer.from_ranks_file(files["ranks"]).with_special_tokens(["<|system|>", "<|user|>", "<|assistant|>"])


def sft_encoder(tok: Tokenizer) -> ChatEncoder:
    return ChatEncoder(ChatTemplate(SFT_TEMPLATE, "default", eos_token=EOT), tok)


def finetune(files, out: Path, *args: str, train=None, val=None) -> int:
    from training.finetune import main

    return main(["--quiet", "--task", "chat", "--train", str(train or files["train"]),
                 "--val", str(val or files["val"]), "--out", str(out), *args])


def events(out: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if e["event"] == kind]


CONV = [Message("system", "Be brief."), Message("user", "the hat"), Message("assistant", "a cat", 1),
        Message("user", "again"), Message("assistant", "no", 0), Message("user", "last"),
        Message("assistant", " then  ", 1)]


# ------------------------------------------------------------------------------------------------ encoding, mask
def test_learned_tokens_are_the_weighted_replies_and_their_end(chat_tok):
    enc = sft_encoder(chat_tok)
    ids, learn = enc.encode(CONV)
    whole = enc.template.render([m.as_dict() for m in CONV], add_generation_prompt=False)
    assert ids == chat_tok.encode_chat(whole)  # the segments tokenize as the whole text does (SFT_TEMPLATE)
    learned = [i for i, flag in zip(ids, learn) if flag]
    assert chat_tok.decode(learned) == f"a cat{EOT}then{EOT}"  # weight-0 "no" and every prompt token are context
    # the prompt of each reply is what the server renders and tokenizes for that request
    for k in (2, 6):
        prompt = chat_tok.encode_chat(enc.template.render([m.as_dict() for m in CONV[:k]]))
        assert ids[: len(prompt)] == prompt and learn[len(prompt)] and not learn[len(prompt) - 1]


def grads(model, x, y) -> torch.Tensor:
    model.zero_grad()
    _, loss = model(x, y)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_loss_mask_context_tokens_change_no_gradient_assistant_tokens_do(chat_tok):
    torch.manual_seed(0)
    model = tiny_model(0, vocab_size=chat_tok.vocab_size, block_size=64).train()
    ids, learn = sft_encoder(chat_tok).encode(CONV)
    row = pack_row(ids, learn)
    x, y = chat_batch([row], chat_tok.eot_id)
    assert torch.equal(x[0], torch.tensor(ids[:-1])) and (y >= 0).sum() == sum(learn[1:])
    base = grads(model, x, y)

    def changed(pos: int) -> torch.Tensor:
        """The targets with the token at `pos` of the conversation replaced (inputs unchanged)."""
        r = row.copy()
        r[pos] = (r[pos] & ~np.uint32(1 << 31) ^ np.uint32(1)) | (r[pos] & np.uint32(1 << 31))
        return chat_batch([r], chat_tok.eot_id)[1]

    def find(text: str) -> int:  # where the (byte-level) tokens of `text` start
        seq = chat_tok.encode_chat(text)
        return next(i for i in range(len(ids)) if ids[i: i + len(seq)] == seq)

    system = find("Be brief") + 1
    user = find("last") + 1
    weight0 = find("<|assistant|>\nno") + 2  # the "n" of the weight-0 reply
    assistant = find("<|assistant|>\na cat") + 2
    assert learn[assistant] and not learn[weight0] and not learn[user] and not learn[system]
    for pos in (system, user, weight0):
        assert torch.equal(grads(model, x, changed(pos)), base), pos
    assert not torch.allclose(grads(model, x, changed(assistant)), base)
    # and no gradient reaches the logits of a context position
    logits, _ = model(x)
    logits.retain_grad()
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1).backward()
    flows = logits.grad[0].abs().sum(-1) > 0
    assert torch.equal(flows, y[0] >= 0)


def test_prompt_completion_forms(chat_tok):
    msgs = parse_conversation({"prompt": "hi", "completion": "ho"})
    assert [(m.role, m.weight) for m in msgs] == [("user", 0), ("assistant", 1)]
    msgs = parse_conversation({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                          {"role": "user", "content": "c"}],
                               "completion": [{"role": "assistant", "content": "d"}]})
    assert [m.weight for m in msgs if m.role == "assistant"] == [0, 1]  # TRL: the prompt's replies are context
    ids, learn = sft_encoder(chat_tok).encode(msgs)
    assert chat_tok.decode([i for i, f in zip(ids, learn) if f]) == f"d{EOT}"


@pytest.mark.parametrize("line,message", [
    ("{nope", ":2: not valid JSON"),
    ("[1]", ":2: expected a JSON object, got list"),
    ('{"text": "a"}', ':2: expected "messages" (or "prompt" and "completion")'),
    ('{"messages": []}', ":2: messages must be a non-empty list of messages"),
    ('{"messages": [{"role": "user", "content": "a"}]}', ":2: no assistant turn (nothing to learn)"),
    ('{"messages": [{"role": "bot", "content": "a"}]}', ":2: messages[0]: unknown role 'bot' (expected system, "
                                                        "user, assistant or tool)"),
    ('{"messages": [{"role": "user", "content": "a", "tool_calls": [{"function": {"name": "f"}}]}]}',
     ":2: messages[0]: only assistant messages carry tool_calls"),
    ('{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]}',
     ":2: messages[0].tool_calls[0]: arguments are not JSON"),
    ('{"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]}',
     ':2: messages[0].tool_calls[0]: expected {"type": "function", "function": {"name": ..., "arguments": ...}}'),
    ('{"tools": [{"type": "web_search"}], "messages": [{"role": "assistant", "content": "a"}]}',
     ':2: tools[0]: expected {"type": "function"'),
    ('{"parallel_tool_calls": 1, "messages": [{"role": "assistant", "content": "a"}]}',
     ":2: parallel_tool_calls must be true or false"),
    ('{"messages": [{"content": "a"}]}', ":2: messages[0]: unknown role None"),
    ('{"messages": [{"role": "user", "content": null}]}', ":2: messages[0]: content must be a string, got NoneType"),
    ('{"messages": [{"role": "user", "content": "a", "weight": 0}]}', ":2: messages[0]: weight is for assistant "
                                                                     "messages only"),
    ('{"messages": [{"role": "assistant", "content": "a", "weight": 2}]}', ":2: messages[0]: weight must be 0 or 1"),
    ('{"messages": [{"role": "assistant", "content": "a", "weight": 0}]}', ":2: no assistant turn to learn (every "
                                                                          "assistant message has weight 0)"),
    ('{"prompt": "a", "completion": ["b"]}', ":2: prompt and completion must both be strings or both be lists"),
])
def test_bad_lines_are_one_line_naming_file_and_line(tmp_path, files, capsys, line, message):
    bad = write_jsonl(tmp_path / "bad.jsonl", [echo_lines(1, 0)[0], line])
    err = one_line_error(capsys, lambda: finetune(files, tmp_path / "o", "--init-from", str(files["base"]), train=bad))
    assert err.startswith("python -m training.finetune: error: ")
    assert f"{bad}{message}" in err


TOOL_LINE = {
    "tools": [{"type": "function", "function": {"name": "find", "description": "look up",
                                                "parameters": {"type": "object", "properties": {"who": {
                                                    "type": "string"}}}}}],
    "parallel_tool_calls": False,
    "messages": [{"role": "user", "content": "who"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "c1", "type": "function", "function": {"name": "find", "arguments": '{"who": "he"}'}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "the hat"},
                 {"role": "assistant", "content": "a cat"}]}


def test_tool_calls_are_learned_as_replies(tmp_path, chat_tok):
    """OpenAI's fine-tuning lines with tools: the template shows the tools (context), the assistant's call is
    learned as its reply is (the call's text and the end of turn), the tool's result is context."""
    f = write_jsonl(tmp_path / "t.jsonl", [TOOL_LINE])
    with TokenDir() as wd:
        data = encode_chat_file(f, sft_encoder(chat_tok), 400, "drop", wd)
    row = data.example(0)
    ids, learn = (row & 0x7FFFFFFF).tolist(), (row >> 31).astype(bool).tolist()
    text = chat_tok.decode(ids)
    assert text.startswith('<|system|>\nYou may call these functions.') and '"name": "find"' in text
    learned = chat_tok.decode([i for i, f in zip(ids, learn) if f])
    assert learned == f'<tool_call>{{"name": "find", "arguments": {{"who": "he"}}}}</tool_call>{EOT}a cat{EOT}'
    assert "<tool_response>\nthe hat\n</tool_response>" in text


def test_overlong_conversations_are_dropped_or_truncated_and_counted(tmp_path, chat_tok):
    long = {"messages": [{"role": "user", "content": "x " * 5}, {"role": "assistant", "content": "y " * 40}]}
    only_prompt_fits = {"messages": [{"role": "user", "content": "x " * 40}, {"role": "assistant", "content": "y"}]}
    f = write_jsonl(tmp_path / "d.jsonl", [*echo_lines(3, 0), long, only_prompt_fits])
    with TokenDir() as wd:
        dropped = encode_chat_file(f, sft_encoder(chat_tok), 40, "drop", wd)
        cut = encode_chat_file(f, sft_encoder(chat_tok), 40, "truncate", wd)
    assert len(dropped) == 3 and dropped.stats["dropped_overlong"] == 2 and dropped.stats["conversations"] == 5
    assert len(cut) == 4 and cut.stats["truncated"] == 1 and cut.stats["dropped_overlong"] == 1
    assert len(cut.example(3)) == 41
    with TokenDir() as wd, pytest.raises(ChatDataError, match=r"no conversations \(all 1 are longer than the "
                                                                r"context of 41 tokens; set overlong=truncate"):
        encode_chat_file(write_jsonl(tmp_path / "l.jsonl", [long]), sft_encoder(chat_tok), 40, "drop", wd)


def test_template_tokens_and_stop(chat_tok):
    sft = ChatTemplate(SFT_TEMPLATE, "default", eos_token=EOT)
    assert template_special_tokens(sft) == ["<|system|>", "<|user|>", "<|assistant|>", EOT]
    assert end_of_turn(sft, list(chat_tok.special_tokens)) == EOT
    chatml = ChatTemplate(CHATML, "chatml", eos_token=EOT)
    assert template_special_tokens(chatml) == ["<|im_start|>", "<|im_end|>", EOT]
    assert end_of_turn(chatml, ["<|im_start|>", "<|im_end|>", EOT]) == "<|im_end|>"


def test_added_tokens_get_new_embedding_rows(files):
    ck = load_checkpoint(files["base"])
    before = ck.model.transformer.wte.weight.detach().clone()
    tok = add_special_tokens(ck.model, ck.tokenizer, ["<|a|>", EOT, "<|b|>"], torch.Generator().manual_seed(0))
    w = ck.model.transformer.wte.weight
    assert tok.special_tokens["<|a|>"] == 259 and tok.special_tokens["<|b|>"] == 260 and w.shape[0] == 261
    assert torch.equal(w[:259], before) and ck.model.lm_head.weight is w and ck.model.config.vocab_size == 261
    assert add_special_tokens(ck.model, tok, ["<|a|>"]) is tok  # nothing new: unchanged


# ---------------------------------------------------------------------------------------------- training runs
def test_few_steps_learn_and_the_checkpoint_carries_template_and_stop(tmp_path, files):
    out = tmp_path / "run"
    assert finetune(files, out, "--init-from", str(files["base"]), *sets("max_iters=12")) == 0
    evals = events(out, "eval")
    assert [e["step"] for e in evals] == [0, 4, 8, 12] and evals[-1]["val_loss"] < 0.8 * evals[0]["val_loss"]
    start = events(out, "start")[0]
    assert start["train_stats"]["examples"] == 120 and start["task"] == "chat"
    assert start["stop_tokens"] == [EOT]
    ck = load_checkpoint(out / "best")
    assert ck.tokenizer.special_tokens == {EOT: 258, "<|system|>": 259, "<|user|>": 260, "<|assistant|>": 261}
    assert ck.config.vocab_size == 262 and ck.metadata["task"] == "chat"
    t = load_chat_template(out / "best", EOT)
    assert t.source == SFT_TEMPLATE and t.stop == [] and not t.lstrip_reply
    assert json.loads((out / "best" / "generation_config.json").read_text()) == {"eos_token_id": [258]}

    # the demonstration's measurements (training/chat/measure.py) run on it
    from training.chat.measure import compare_loss, throughput

    res = compare_loss(str(files["base"]), str(out / "best"), str(files["val"]))
    assert res["conversations"] == 24 and res["tuned"]["nats_per_token"] < res["base"]["nats_per_token"]
    text = tmp_path / "text.txt"
    text.write_text(" ".join(WORDS * 20))
    speed = throughput(str(files["base"]), str(files["train"]), str(text), rounds=1, steps=2, batch_size=4)
    assert speed["chat_positions_per_s"] > 0 and 0 < speed["learned_fraction"] < 1


def test_a_chatml_template_adds_its_tokens_and_stops_at_im_end(tmp_path, files):
    tpl = tmp_path / "chatml.jinja"
    tpl.write_text(CHATML)
    out = tmp_path / "run"
    assert finetune(files, out, "--init-from", str(files["base"]), "--chat-template", str(tpl),
                    *sets("max_iters=1", "eval_interval=1")) == 0
    ck = load_checkpoint(out / "last")
    assert {"<|im_start|>": 259, "<|im_end|>": 260}.items() <= ck.tokenizer.special_tokens.items()
    t = load_chat_template(out / "last", EOT)
    assert t.source == CHATML and t.stop == ["<|im_end|>"]
    assert json.loads((out / "last" / "generation_config.json").read_text()) == {"eos_token_id": [258, 260]}


def test_resume_mid_epoch_reproduces_the_uninterrupted_run_exactly(tmp_path, files):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ("eval_interval=3", "lr_decay_iters=9", "grad_accum=2", "dropout=0.1", "eval_examples=8")
    init = ("--init-from", str(files["base"]))
    assert finetune(files, full, *init, *sets("max_iters=9", *common)) == 0
    assert finetune(files, part, *init, *sets("max_iters=5", *common)) == 0  # step 5: mid-epoch (epoch = 7.5)
    assert torch.load(part / "last" / TRAINING_STATE, weights_only=True)["step"] == 5
    assert finetune(files, part, "--resume", "--set", "max_iters=9") == 0
    a, b = events(full, "train"), events(part, "train")
    assert [e["step"] for e in b] == list(range(1, 10))
    assert [e["loss"] for e in a] == [e["loss"] for e in b]  # bit-for-bit
    wa, wb = load_file(full / "last" / "model.safetensors"), load_file(part / "last" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    config = "tokenizer_config.json"
    assert (part / "last" / config).read_text() == (full / "last" / config).read_text()


def test_cli_refusals(tmp_path, files, capsys):
    def err(*args, **kw) -> str:
        return one_line_error(capsys, lambda: finetune(files, tmp_path / "o", *args, **kw))

    init = ("--init-from", str(files["base"]))
    assert "--lm-weight is for the classification tasks" in err(*init, "--lm-weight", "0.5")
    assert "cannot read chat template" in err(*init, "--chat-template", str(tmp_path / "none.jinja"))
    assert "overlong must be one of 'drop', 'truncate'" in err(*init, "--set", "overlong=cut")
    bad = tmp_path / "rewrite.jinja"  # renders the last message only: earlier turns are not a prefix
    bad.write_text("{{ messages[-1].content }}")
    two = write_jsonl(tmp_path / "two.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                             {"role": "assistant", "content": "b"}]}])
    assert "does not render" in err(*init, "--chat-template", str(bad), train=two)


# ---------------------------------------------------------------------------------- serve and export the result
CONVERSATIONS = [
    [{"role": "system", "content": "Echo in capitals."}, {"role": "user", "content": "grape"}],
    [{"role": "system", "content": "Be brief.\n\nVery."}, {"role": "user", "content": "the hat"},
     {"role": "assistant", "content": "THE HAT"}, {"role": "user", "content": "  again, with <|user|> inside "}],
    [{"role": "system", "content": "Speak as a Dane."}, {"role": "user", "content": "Who's there?"},
     {"role": "assistant", "content": "Nay, answer me."}, {"role": "user", "content": "Long live the king!"}],
]


def test_round_trip_fine_tune_serve_export_transformers(tmp_path, files):
    from tests.app_helpers import app_client

    out = tmp_path / "run"
    assert finetune(files, out, "--init-from", str(files["base"]), *sets("max_iters=2", "eval_interval=2")) == 0
    ck_dir = out / "best"
    ck = load_checkpoint(ck_dir)
    template = load_chat_template(ck_dir, EOT)
    ours = [ck.tokenizer.encode_chat(template.render(c)) for c in CONVERSATIONS]
    assert all(ids[-2:] == [ck.tokenizer.special_tokens["<|assistant|>"], 10] for ids in ours)
    with app_client(ck_dir) as client:
        assert client.get("/tokenizer_info").json()["chat_template"] == SFT_TEMPLATE
        for conv, ids in zip(CONVERSATIONS, ours):
            assert client.post("/tokenize", json={"messages": conv}).json()["tokens"] == ids
            if len(ids) >= 64:  # the tiny model's context
                continue
            r = client.post("/v1/chat/completions", json={"messages": conv, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(ids)

    transformers = pytest.importorskip("transformers")
    from model.export_hf import export

    hf_dir = export(ck_dir, tmp_path / "hf")
    hf = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    for conv, ids in zip(CONVERSATIONS, ours):
        got = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        got = got["input_ids"] if not isinstance(got, list) else got
        assert got == ids
        assert hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=False) == template.render(conv)
    assert json.loads((hf_dir / "generation_config.json").read_text())["eos_token_id"] == [ck.tokenizer.eot_id]
    assert hf.eos_token == EOT and hf.convert_tokens_to_ids("<|assistant|>") == 261


def test_tool_calls_round_trip_fine_tune_serve_transformers(tmp_path, files):
    """A fine-tune on tool-calling lines carries a template that renders tools: the server takes tool_choice auto
    and parses a Hermes call (here forced by a regex: a 2-step model writes none of its own), /tokenize renders
    tool history as training did, and transformers' apply_chat_template(tools=...) renders what we render."""
    from tests.app_helpers import app_client

    ranks = files["ranks"]
    tok = Tokenizer.from_ranks_file(ranks)
    base = save_checkpoint(tmp_path / "base", tiny_model(seed=0, vocab_size=tok.vocab_size, block_size=512), tok,
                           tokenizer_file=ranks)
    train = write_jsonl(tmp_path / "t.jsonl", [TOOL_LINE] * 8)
    out = tmp_path / "run"
    assert finetune(files, out, "--init-from", str(base), *sets("max_iters=2", "eval_interval=2", "batch_size=2"),
                    train=train, val=train) == 0
    ck_dir = out / "best"
    template = load_chat_template(ck_dir, EOT)
    assert template.renders_tools
    tools, history = TOOL_LINE["tools"], TOOL_LINE["messages"][:3]
    regex = r'<tool_call>\{"name": "find", "arguments": \{"who": "[a-z]{1,4}"\}\}</tool_call>'
    with app_client(ck_dir) as client:
        r = client.post("/v1/chat/completions", json={"messages": history[:1], "tools": tools, "max_tokens": 120,
                                                      "seed": 1, "structured_outputs": {"regex": regex}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["find"]
        assert set(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])) == {"who"}
        ids = client.post("/tokenize", json={"messages": history}).json()["tokens"]
    rendered = [Message("user", "who").as_dict(), {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "find", "arguments": {"who": "he"}}}]},
        {"role": "tool", "content": "the hat", "tool_call_id": "c1"}]
    ck = load_checkpoint(ck_dir)
    assert ids == ck.tokenizer.encode_chat(template.render(rendered))  # /tokenize takes no tools: none rendered

    transformers = pytest.importorskip("transformers")
    from model.export_hf import export

    hf = transformers.AutoTokenizer.from_pretrained(str(export(ck_dir, tmp_path / "hf")))
    assert hf.apply_chat_template(rendered, tools=tools, add_generation_prompt=True, tokenize=False) == \
        template.render(rendered, tools=tools)
