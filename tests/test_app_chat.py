"""/v1/chat/completions end to end: the bundled Shakespeare model chats through the default transcript
template, and a reply stops at the next `You:` (a tiny model trained to continue the transcript past it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.app_helpers import app_client, sse_events
from tests.helpers import tiny_model, write_byte_ranks

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]
REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "checkpoints" / "shakespeare"


def test_bundled_model_answers_a_two_turn_chat():
    messages = [{"role": "user", "content": "Good morrow, my lord."},
                {"role": "assistant", "content": "Good morrow, cousin."},
                {"role": "user", "content": "What news from Verona?"}]
    with app_client(BUNDLED, max_batch_size=2) as c:
        toks = c.post("/tokenize", json={"messages": messages}).json()
        text = c.post("/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"]
        assert text == ("You: Good morrow, my lord.\nModel: Good morrow, cousin.\nYou: What news from Verona?\n"
                        "Model:")
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 40, "seed": 1})
        assert r.status_code == 200, r.text
        body = r.json()
        reply = body["choices"][0]["message"]["content"]
        assert reply.strip() and reply == reply.lstrip() and "You:" not in reply
        assert body["usage"]["prompt_tokens"] == toks["count"] and body["choices"][0]["finish_reason"] in (
            "stop", "length")
        again = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 40, "seed": 1}).json()
        assert again["choices"][0]["message"]["content"] == reply  # seeded: reproducible
        assert c.get("/info").json()["chat_template"].startswith("default")


@pytest.fixture(scope="module")
def transcript_ckpt(tmp_path_factory) -> Path:
    """A byte-level model trained (a few seconds) on a transcript, so its greedy reply runs on into `You:`."""
    from model.checkpoint import save_checkpoint
    from model.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("chat")
    ranks = write_byte_ranks(d / "bytes.tiktoken")
    tok = Tokenizer.from_ranks_file(ranks)
    model = tiny_model(0, vocab_size=tok.vocab_size, block_size=64, dropout=0.0)
    text = "You: hi\nModel: hello there\nYou: bye\nModel: farewell\n" * 20
    ids = torch.tensor(tok.encode(text))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        starts = torch.randint(0, len(ids) - 65, (16,), generator=g)
        x = torch.stack([ids[s:s + 64] for s in starts])
        y = torch.stack([ids[s + 1:s + 65] for s in starts])
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return save_checkpoint(d / "m", model, tok, {"note": "chat test"}, tokenizer_file=ranks)


def test_reply_stops_at_the_next_you(transcript_ckpt):
    from engine.generate import generate
    from engine.params import SamplingParams
    from model.checkpoint import load_checkpoint

    prompt = "You: hi\nModel:"
    ck = load_checkpoint(transcript_ckpt)
    with torch.inference_mode():
        free = generate(ck.model, ck.tokenizer, [ck.tokenizer.encode(prompt)],
                        SamplingParams(max_new_tokens=20, temperature=0))[0].text
    assert "\nYou:" in free, free  # left alone, the model writes the user's next turn
    expected = free[: free.index("\nYou:")].lstrip()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0}
    with app_client(transcript_ckpt) as c:
        r = c.post("/v1/chat/completions", json=body).json()
        assert r["choices"][0]["message"]["content"] == expected
        assert r["choices"][0]["finish_reason"] == "stop"
        events = sse_events(c.post("/v1/chat/completions", json={**body, "stream": True}).text)
        chunks = [e for e in events if e != "[DONE]"]
        assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == expected
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"


def test_a_streamed_reply_carries_the_logprobs_of_a_last_token_that_releases_no_text(tiny_ckpt):
    # the reply ends at a stop token id (its text is left out): the last chunk has no content, but its logprobs
    # entry is there, as in the non-streaming reply (the stream dropped it: logprobs null on the last chunk)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 1}
    with app_client(tiny_ckpt) as c:
        ids = c.post("/tokenize", json={"messages": body["messages"], "add_generation_prompt": True}).json()["tokens"]
        prompt = c.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        free = c.post("/generate", json={"inputs": prompt, "parameters": {
            "max_new_tokens": 6, "temperature": 0, "details": True}}).json()["details"]["tokens"]
        stop = free[2]["id"]
        body["stop_token_ids"] = [stop]
        whole = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert whole["finish_reason"] == "stop"
        events = [e for e in sse_events(c.post("/v1/chat/completions", json={**body, "stream": True}).text)
                  if e != "[DONE]"]
        streamed = [x for e in events for ch in e["choices"] if ch["logprobs"] for x in ch["logprobs"]["content"]]
        assert streamed == whole["logprobs"]["content"]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
