"""The HTTP API in-process (fastapi TestClient): the operations routes, TGI's and OpenAI's generating routes in
both stream formats, prompt scoring, settings. Refusals (bad input, auth, CORS, time limits) are in
tests/test_app_refusals.py; load, warm-up, draining and liveness in tests/test_app_load.py."""

from __future__ import annotations

import pytest
import torch

from tests.app_helpers import app_client, assert_error, reference_generate, sse_events
from tests.helpers import BLOCK

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

METRIC_NAMES = ["gpt_requests_total", "gpt_prompt_tokens_total", "gpt_generated_tokens_total", "gpt_queue_size",
                "gpt_batch_size", "gpt_queue_time_seconds", "gpt_time_to_first_token_seconds",
                "gpt_inter_token_latency_seconds", "gpt_request_latency_seconds"]


@pytest.fixture(scope="module")
def client(tiny_ckpt):
    with app_client(tiny_ckpt) as c:
        yield c



# ------------------------------------------------------------------------------------------- operations
def test_health_info_models_metrics(client, tiny_ckpt):
    assert client.get("/health").json() == {"status": "ready"}
    info = client.get("/info").json()
    assert info["checkpoint"] == str(tiny_ckpt) and info["metadata"]["note"] == "app tests"
    assert info["config"]["block_size"] == BLOCK and info["config"]["n_layer"] == 2
    assert (info["device"], info["dtype"]) == ("cpu", "fp32")
    assert info["max_total_tokens"] == BLOCK and info["max_prompt_tokens"] == BLOCK - 1
    assert info["max_batch_size"] == 8 and info["version"] and info["model_id"] == "tiny"
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in METRIC_NAMES:
        assert f"# TYPE {name} " in r.text or f"# TYPE {name.removesuffix('_total')} " in r.text, name
    spec = client.get("/openapi.json").json()  # /docs documents the hand-parsed bodies too
    assert spec["paths"]["/generate"]["post"]["requestBody"] and "TGIParameters" in spec["components"]["schemas"]


def test_index_and_static(client, tiny_ckpt, tmp_path, monkeypatch):
    import app.routes.ops as ops_routes

    r = client.get("/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"] and "<html" in r.text.lower()
    if (ops_routes.STATIC_DIR / "index.html").is_file():
        assert client.get("/static/index.html").text == r.text
    assert_error(client.get("/static/no-such-file.js"), 404)
    monkeypatch.setattr(ops_routes, "STATIC_DIR", tmp_path / "nothing-here")
    with app_client(tiny_ckpt) as c:  # no playground installed: a minimal page, and /static still answers
        page = c.get("/")
        assert page.status_code == 200 and "/docs" in page.text and "tiny" in page.text
        assert_error(c.get("/static/index.html"), 404)


def test_unknown_route_and_method_are_json(client):
    assert_error(client.get("/nope"), 404, error_type="not_found")
    assert_error(client.get("/generate"), 405, error_type="method_not_allowed")


# ------------------------------------------------------------------------------------------- TGI routes
def test_generate_greedy_equals_reference_on_every_route(client, tiny_ckpt):
    ref = reference_generate(tiny_ckpt, "hello", max_new_tokens=12, temperature=0)
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 12, "details": True}}
    for route in ("/generate", "/"):
        out = client.post(route, json=body).json()
        if route == "/":  # TGI's compatibility route answers with a list of one result
            assert isinstance(out, list) and len(out) == 1
            out = out[0]
        assert out["generated_text"] == ref.text
        d = out["details"]
        assert d["finish_reason"] == "length" and d["generated_tokens"] == 12 and d["seed"] is None
        assert d["prompt_tokens"] == len(ref.prompt)
        assert [t["id"] for t in d["tokens"]] == ref.tokens
        assert [t["logprob"] for t in d["tokens"]] == pytest.approx([e.logprob for e in ref.events], abs=1e-4)
        assert all(set(t) == {"id", "text", "logprob", "special"} for t in d["tokens"])
    plain = client.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 12}}).json()
    assert plain == {"generated_text": ref.text}


@pytest.mark.parametrize("route,body_stream", [("/generate_stream", None), ("/generate", True), ("/", True)])
def test_tgi_stream_format(client, tiny_ckpt, route, body_stream):
    ref = reference_generate(tiny_ckpt, "abc", max_new_tokens=6, temperature=0.8, seed=7)
    body = {"inputs": "abc", "parameters": {"max_new_tokens": 6, "temperature": 0.8, "seed": 7, "details": True}}
    if body_stream is not None:
        body["stream"] = body_stream
    r = client.post(route, json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data:") for line in r.text.split("\n\n") if line.strip())
    events = sse_events(r.text)
    assert [e["index"] for e in events] == list(range(1, 7))
    for e in events[:-1]:
        assert e["generated_text"] is None and e["details"] is None
        assert set(e["token"]) == {"id", "text", "logprob", "special"}
    last = events[-1]
    assert last["generated_text"] == ref.text == "".join(e["token"]["text"] for e in events)
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 6, "seed": 7,
                               "input_length": 3, "prompt_tokens": 3}
    assert [e["token"]["id"] for e in events] == ref.tokens


def test_stream_without_details_has_no_details(client):
    events = sse_events(client.post("/generate_stream", json={"inputs": "abc",
                                                               "parameters": {"max_new_tokens": 3}}).text)
    assert events[-1]["details"] is None and isinstance(events[-1]["generated_text"], str)


def test_tgi_sampling_rules(client, tiny_ckpt):
    def gen(**params):
        return client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 16, "details": True,
                                                                             **params}}).json()

    greedy = reference_generate(tiny_ckpt, "hi", max_new_tokens=16, temperature=0).text
    assert gen()["generated_text"] == greedy  # TGI: no sampling parameter → greedy
    assert gen(do_sample=False, seed=3)["generated_text"] == greedy
    assert gen(temperature=0, do_sample=True)["generated_text"] == greedy  # temperature 0 is greedy here
    assert gen(top_p=1.0)["generated_text"] == greedy  # accepted (TGI refuses 1.0), and neutral
    sampled = gen(do_sample=True, seed=11)
    assert sampled["details"]["seed"] == 11
    assert sampled["generated_text"] == reference_generate(tiny_ckpt, "hi", max_new_tokens=16, temperature=1.0,
                                                           seed=11).text
    warm = gen(temperature=0.9)  # a warper alone turns sampling on, with a fresh seed reported
    seed = warm["details"]["seed"]
    assert isinstance(seed, int) and gen(temperature=0.9, seed=seed)["generated_text"] == warm["generated_text"]


def test_stop_sequences_and_full_text(client):
    base = client.post("/generate", json={"inputs": "once", "parameters": {
        "max_new_tokens": 40, "do_sample": True, "seed": 5}}).json()["generated_text"]
    stop = base[10:12]
    cut = base[:base.find(stop)]
    out = client.post("/generate", json={"inputs": "once", "parameters": {
        "max_new_tokens": 40, "do_sample": True, "seed": 5, "stop": [stop, "\x00never"], "details": True}}).json()
    assert out["generated_text"] == cut and out["details"]["finish_reason"] == "stop_sequence"
    full = client.post("/generate", json={"inputs": "once", "parameters": {
        "max_new_tokens": 40, "do_sample": True, "seed": 5, "return_full_text": True}}).json()
    assert full["generated_text"] == "once" + base


def test_top_n_tokens_and_truncate(client):
    out = client.post("/generate", json={"inputs": "hello", "parameters": {
        "max_new_tokens": 3, "details": True, "top_n_tokens": 2}}).json()
    tops = out["details"]["top_tokens"]
    assert len(tops) == 3 and all(len(t) == 2 for t in tops)
    assert [t[0]["id"] for t in tops] == [t["id"] for t in out["details"]["tokens"]]  # greedy picks the best
    # truncate keeps the last N prompt tokens
    long = client.post("/generate", json={"inputs": "x" * 200 + "hello", "parameters": {
        "max_new_tokens": 5, "truncate": 5, "details": True}}).json()
    short = client.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 5}}).json()
    assert long["generated_text"] == short["generated_text"] and long["details"]["prompt_tokens"] == 5


def test_context_limits(client):
    assert_error(client.post("/generate", json={"inputs": "a" * 200}), 422, "inputs")
    assert_error(client.post("/generate", json={"inputs": "a" * 100, "parameters": {"max_new_tokens": 50}}),
                 422, "parameters.max_new_tokens")
    assert_error(client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": BLOCK}}),
                 422, "parameters.max_new_tokens")
    # without max_new_tokens the default is lowered to what fits
    out = client.post("/generate", json={"inputs": "a" * 120, "parameters": {"details": True}}).json()
    assert out["details"]["generated_tokens"] == BLOCK - 120
    out = client.post("/generate", json={"inputs": "a" * 27, "parameters": {"max_new_tokens": BLOCK - 27}})
    assert out.status_code == 200


# ------------------------------------------------------------------------------------------- OpenAI
def test_completions(client, tiny_ckpt):
    ref = reference_generate(tiny_ckpt, "hello", max_new_tokens=8, temperature=0)
    r = client.post("/v1/completions", json={"model": "whatever", "prompt": "hello", "max_tokens": 8,
                                             "temperature": 0, "logprobs": 2})
    out = r.json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-") and out["model"] == "tiny"
    choice = out["choices"][0]
    assert choice["text"] == ref.text and choice["finish_reason"] == "length" and choice["index"] == 0
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == ref.text and len(lp["token_logprobs"]) == 8
    assert lp["text_offset"][0] == 0 and all(len(t) == 2 for t in lp["top_logprobs"])
    n = len(ref.prompt)
    assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 8, "total_tokens": n + 8,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    # a list of one string, token ids, echo; default max_tokens is 16 (OpenAI's)
    same = client.post("/v1/completions", json={"prompt": ["hello"], "max_tokens": 8, "temperature": 0}).json()
    ids = client.post("/v1/completions", json={"prompt": ref.prompt, "max_tokens": 8, "temperature": 0}).json()
    echo = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "temperature": 0,
                                                "echo": True}).json()
    assert same["choices"][0]["text"] == ids["choices"][0]["text"] == ref.text
    assert echo["choices"][0]["text"] == "hello" + ref.text and same["choices"][0]["logprobs"] is None
    dflt = client.post("/v1/completions", json={"prompt": "hello", "temperature": 0}).json()
    assert dflt["usage"]["completion_tokens"] == 16
    seeded = [client.post("/v1/completions", json={"prompt": "hi", "seed": 3, "max_tokens": 10}).json()
              for _ in range(2)]
    assert seeded[0]["choices"][0]["text"] == seeded[1]["choices"][0]["text"]


def test_completions_stream(client, tiny_ckpt):
    ref = reference_generate(tiny_ckpt, "hello", max_new_tokens=5, temperature=0)
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "temperature": 0, "stream": True,
                                             "logprobs": 1, "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert all(c["object"] == "text_completion" and c["choices"][0]["logprobs"]["tokens"] for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


# ------------------------------------------------------------------------------------------- scoring
SCORED = "the king is dead, long live the king! the then there; " * 2  # 60+ tokens: more than one prefill chunk


def reference_prompt_logprobs(ckpt, prompt_ids: list[int]) -> list[float]:
    """log P(token i | tokens < i) from one full forward pass (fp32)."""
    from model.checkpoint import load_checkpoint

    c = load_checkpoint(ckpt)
    with torch.inference_mode():
        logits, _ = c.model(torch.tensor([prompt_ids]))
    lsm = torch.log_softmax(logits[0, :, :c.tokenizer.vocab_size].float(), -1)
    return [lsm[i - 1, t].item() for i, t in enumerate(prompt_ids) if i]


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(client, tiny_ckpt):
    ids = client.post("/tokenize", json={"prompt": SCORED, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) > 32  # the server's prefill chunk
    expected = reference_prompt_logprobs(tiny_ckpt, ids)
    # lm-evaluation-harness' loglikelihood request, as local-completions sends it
    body = {"model": "tiny", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    out = client.post("/v1/completions", json=body).json()
    (choice,) = out["choices"]
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == pytest.approx(expected, abs=1e-5)
    assert "".join(lp["tokens"][:n]) == SCORED and choice["text"].startswith(SCORED)
    assert lp["text_offset"][:n] == [len("".join(lp["tokens"][:i])) for i in range(n)]
    assert lp["text_offset"][n] == len(SCORED)  # the generated token follows the echoed prompt
    for tok, top, lpv in zip(lp["tokens"][1:n], lp["top_logprobs"][1:n], lp["token_logprobs"][1:n]):
        assert top[tok] == lpv and 1 <= len(top) <= 2  # the token itself and the most likely one
        assert max(top.values()) >= lpv
    # lm-eval's greediness test (token logprob == the best in top_logprobs) agrees with the model's argmax
    from model.checkpoint import load_checkpoint

    with torch.inference_mode():
        argmax = load_checkpoint(tiny_ckpt).model(torch.tensor([ids]))[0][0, :-1].argmax(-1).tolist()
    greedy = [lpv == max(top.values()) for top, lpv in zip(lp["top_logprobs"][1:n], lp["token_logprobs"][1:n])]
    assert greedy == [a == t for a, t in zip(argmax, ids[1:])]
    assert out["usage"]["prompt_tokens"] == n and out["usage"]["completion_tokens"] == 1
    # scoring only: max_tokens 0 with echo ends after the prefill, finish_reason length, nothing generated
    score = client.post("/v1/completions", json={**body, "max_tokens": 0}).json()
    (only,) = score["choices"]
    assert only["text"] == SCORED and only["finish_reason"] == "length"
    assert only["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n]
    assert score["usage"]["completion_tokens"] == 0
    # vLLM's prompt_logprobs field: token id → logprob, rank, decoded token
    v = client.post("/v1/completions", json={"prompt": SCORED, "max_tokens": 0, "echo": True,
                                             "prompt_logprobs": 2}).json()["choices"][0]
    assert v["logprobs"] is None and v["prompt_logprobs"][0] is None and len(v["prompt_logprobs"]) == n
    for i, entry in enumerate(v["prompt_logprobs"][1:], 1):
        assert entry[str(ids[i])]["logprob"] == pytest.approx(expected[i - 1], abs=1e-5)
        assert 2 <= len(entry) <= 3 and entry[str(ids[i])]["rank"] >= 1
        best = [e for e in entry.values() if e["rank"] == 1]
        assert len(best) == 1 and best[0]["logprob"] >= entry[str(ids[i])]["logprob"]


def test_echo_logprobs_batched_and_streamed(client, tiny_ckpt):
    ids = client.post("/tokenize", json={"prompt": SCORED}).json()["tokens"]
    expected = reference_prompt_logprobs(tiny_ckpt, ids)
    short = client.post("/tokenize", json={"prompt": "hello there"}).json()["tokens"]
    body = {"prompt": [ids, short], "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True}
    whole = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert whole["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=1e-5)
    assert whole["choices"][1]["logprobs"]["token_logprobs"][1:len(short)] == pytest.approx(
        reference_prompt_logprobs(tiny_ckpt, short), abs=1e-5)
    r = client.post("/v1/completions", json={**body, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    per_choice: dict[int, list] = {0: [], 1: []}
    for e in events[:-1]:
        (c,) = e["choices"]
        per_choice[c["index"]].append(c)
    for index, chunks in per_choice.items():
        first = chunks[0]  # the prompt's entries come first, in one chunk, with the prompt's text
        prompt_ids = ids if index == 0 else short
        assert first["logprobs"]["token_logprobs"][0] is None
        assert len(first["logprobs"]["tokens"]) == len(prompt_ids) and first["finish_reason"] is None
        assert "".join(c["text"] for c in chunks) == whole["choices"][index]["text"]
        lps = [x for c in chunks for x in c["logprobs"]["token_logprobs"]]
        assert lps == pytest.approx(whole["choices"][index]["logprobs"]["token_logprobs"], abs=1e-6)
        offsets = [x for c in chunks for x in c["logprobs"]["text_offset"]]
        assert offsets == whole["choices"][index]["logprobs"]["text_offset"]
        assert chunks[-1]["finish_reason"] == "length"
    # streamed scoring only: one chunk with the prompt and finish_reason, then [DONE]
    events = sse_events(client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 0, "echo": True,
                                                             "logprobs": 0, "stream": True}).text)
    assert len(events) == 2 and events[0]["choices"][0]["finish_reason"] == "length"
    assert events[0]["choices"][0]["text"] == "hello there"


def test_tgi_decoder_input_details_fills_prefill(client, tiny_ckpt):
    ids = client.post("/tokenize", json={"prompt": SCORED}).json()["tokens"]
    expected = reference_prompt_logprobs(tiny_ckpt, ids)
    for route in ("/generate", "/"):
        out = client.post(route, json={"inputs": SCORED, "parameters": {"max_new_tokens": 2,
                                                                        "decoder_input_details": True}}).json()
        details = (out[0] if route == "/" else out)["details"]  # decoder_input_details implies details (TGI)
        prefill = details["prefill"]
        assert [t["id"] for t in prefill] == ids and prefill[0]["logprob"] is None
        assert [t["logprob"] for t in prefill[1:]] == pytest.approx(expected, abs=1e-5)
        assert "".join(t["text"] for t in prefill) == SCORED and set(prefill[0]) == {"id", "text", "logprob"}
        assert len(details["tokens"]) == 2
    plain = client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2, "details": True}})
    assert plain.json()["details"]["prefill"] == []


def test_tokenizer_info_and_tokenize_as_lm_eval_checks_them(client):
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["bos_token"] == "<|endoftext|>"
    assert info["pad_token"] is None and info["chat_template"] and info["model_max_length"] == BLOCK
    assert info["tokenizer_class"] == "GPT2Tokenizer"
    # lm-eval's RemoteTokenizer: eos_token_id = tokenize(eos_token)[0]
    r = client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert r["tokens"] == [info["eos_token_id"]]
    same = client.post("/tokenize", json={"prompt": "test", "add_special_tokens": True}).json()["tokens"]
    assert same == client.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()["tokens"]


def test_logit_bias_min_tokens_stop_token_ids_over_http(client, tiny_ckpt):
    ref = reference_generate(tiny_ckpt, "hello", max_new_tokens=6, temperature=0, stop_at_eos=False)
    banned = ref.tokens[0]
    out = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0,
                                               "ignore_eos": True, "logit_bias": {str(banned): -100}}).json()
    forced = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0.9, "seed": 1,
                                                  "logit_bias": {"120": 100}, "logprobs": 0}).json()
    assert "".join(forced["choices"][0]["logprobs"]["tokens"]) == "x" * 4  # token 120 is the byte "x"
    got = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0,
                                               "ignore_eos": True, "logprobs": 0}).json()
    assert got["choices"][0]["text"] == ref.text  # no bias: the model's own greedy choice
    assert out["choices"][0]["text"] != ref.text
    # stop_token_ids: the greedy reply ends at the third token (its text left out), finish_reason stop
    stop = ref.tokens[2]
    first = ref.tokens.index(stop)
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                             "stop_token_ids": [stop], "logprobs": 0}).json()["choices"][0]
    assert r["finish_reason"] == "stop" and len(r["logprobs"]["tokens"]) == first + 1
    assert r["text"] == "".join(r["logprobs"]["tokens"][:first])
    # min_tokens past it: the stop token cannot come first
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 6,
                                                  "temperature": 0, "min_tokens": 6, "stop_token_ids": [stop],
                                                  "ignore_eos": True}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 6


# ------------------------------------------------------------------------------------------- settings
def test_settings_env_and_cli(monkeypatch):
    from app.__main__ import parse_args
    from app.config import SettingsError, load_settings

    monkeypatch.setenv("GPT_PORT", "1234")
    monkeypatch.setenv("GPT_CORS_ORIGINS", "https://a.example, https://b.example")
    monkeypatch.setenv("GPT_API_KEY", "k")
    monkeypatch.setenv("GPT_MAX_BATCH_SIZE", "3")
    s = load_settings()
    assert (s.port, s.cors_origins, s.api_key.get_secret_value(), s.max_batch_size) == (
        1234, ["https://a.example", "https://b.example"], "k", 3)
    args = parse_args(["--port", "999", "--checkpoint", "x", "--dtype", "bf16", "--max-batch-size", "5"])
    s = load_settings(**{k: v for k, v in vars(args).items() if v is not None})
    assert (s.port, str(s.checkpoint), s.dtype, s.max_batch_size) == (999, "x", "bf16", 5)  # flags win
    monkeypatch.setenv("GPT_PORT", "not-a-port")
    with pytest.raises(SettingsError, match="GPT_PORT"):
        load_settings()
    monkeypatch.setenv("GPT_PORT", "80")
    with pytest.raises(SettingsError, match="device"):
        load_settings(device="tpu")
