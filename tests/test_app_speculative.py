"""Speculative decoding as the server takes it: settings (one-line errors), the core built from them (a draft with
another tokenizer refused at start-up in one line), /info, Prometheus, and OpenAI usage unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.build import CoreConfig, StartupError, build_core

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = str(REPO / "checkpoints" / "shakespeare")


@pytest.mark.parametrize("kw, words", [
    (dict(speculative="medusa"), "unknown speculative method 'medusa'"),
    (dict(speculative="draft"), "needs a checkpoint"),
    (dict(num_speculative_tokens=0), "num_speculative_tokens.*greater than or equal to 1"),
    (dict(speculative_ngram_min=5), "speculative_ngram_min \\(5\\) must be <= speculative_ngram_max"),
    (dict(speculative_max_batch=0), "speculative_max_batch")])
def test_bad_speculative_settings_are_one_line_errors(kw, words):
    from app.config import SettingsError, load_settings

    with pytest.raises(SettingsError, match=words) as e:
        load_settings(**kw)
    assert "\n" not in str(e.value)


def test_settings_reach_the_core():
    from app.config import load_settings

    s = load_settings(speculative="ngram", num_speculative_tokens=6, speculative_max_batch=2)
    cfg = CoreConfig.from_settings(s)
    assert (cfg.speculative, cfg.num_speculative_tokens, cfg.speculative_max_batch) == ("ngram", 6, 2)


def test_a_draft_with_another_tokenizer_is_refused_at_start_up(tiny_ckpt):
    cfg = CoreConfig(checkpoint=SHAKESPEARE, device="cpu", dtype="fp32", kv_cache_memory="16MB", warmup=False,
                     speculative=f"draft:{tiny_ckpt}")
    with pytest.raises(StartupError, match="vocabulary of 261 tokens, the served model 2048") as e:
        build_core(cfg)
    assert "\n" not in str(e.value)
    cfg = CoreConfig(checkpoint=SHAKESPEARE, device="cpu", dtype="fp32", kv_cache_memory="16MB", warmup=False,
                     speculative="draft:/nonexistent/ckpt")
    with pytest.raises(StartupError, match="cannot load the draft model") as e:
        build_core(cfg)
    assert "\n" not in str(e.value)


def test_a_draft_core_reports_its_settings():
    cfg = CoreConfig(checkpoint=SHAKESPEARE, device="cpu", dtype="fp32", kv_cache_memory="16MB", warmup=False,
                     speculative=f"draft:{SHAKESPEARE}", num_speculative_tokens=3)
    core, info, _ = build_core(cfg)
    assert info["speculative"]["method"] == "draft" and info["speculative"]["num_speculative_tokens"] == 3
    assert core.speculator.draft is not None and core.stats()["speculative"]["proposed_tokens"] == 0


def test_info_and_the_start_up_log_state_the_draft_models_kv_cache(caplog):
    from fastapi.testclient import TestClient

    from tests.app_helpers import make_app, wait_ready

    with caplog.at_level("INFO", logger="app"), TestClient(make_app(
            Path(SHAKESPEARE), speculative=f"draft:{SHAKESPEARE}", max_batch_size=2, warmup=False,
            log_level="info")) as client:
        wait_ready(client.get)
        kv = client.get("/info").json()["kv_cache"]
    assert kv["draft_per_slot"] == kv["per_slot"] > 0  # the draft is the served model: the same slot
    assert kv["draft_bytes"] == 2 * kv["draft_per_slot"] == kv["bytes"]
    assert f"the draft model's {kv['draft_bytes'] / 1e6:.1f} MB" in caplog.text


def test_metrics_and_info_report_proposals_and_acceptance():
    from fastapi.testclient import TestClient

    from tests.app_helpers import make_app, wait_ready

    with TestClient(make_app(Path(SHAKESPEARE), speculative="ngram", warmup=False)) as client:
        wait_ready(client.get)
        body = {"prompt": "ROMEO:\nI'll not", "max_tokens": 60, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 60  # every token counted once, however many came per step
        info = client.get("/info").json()
        assert info["speculative"]["method"] == "ngram"
        spec = info["engine"]["speculative"]
        assert spec["accepted_tokens"] > 0 and spec["proposed_tokens"] >= spec["accepted_tokens"]
        text = client.get("/metrics").text
        assert 'gpt_spec_proposed_tokens_total{method="ngram"}' in text
        assert 'gpt_spec_accepted_tokens_total{method="ngram"}' in text
        assert 'gpt_spec_acceptance_rate{method="ngram"}' in text
        assert "gpt_generated_tokens_total 60.0" in text  # the core's count too: a verified row's every token


def test_served_text_streams_and_stop_strings_are_those_without_speculation():
    from fastapi.testclient import TestClient

    from tests.app_helpers import make_app, sse_events, wait_ready

    bodies = [{"prompt": "ROMEO:\nI'll not", "max_tokens": 50, "temperature": 0, "logprobs": 2},
              {"prompt": "JULIET:\n", "max_tokens": 50, "temperature": 0.8, "seed": 4},
              {"prompt": "ROMEO:\nI'll not", "max_tokens": 50, "temperature": 0, "stop": ["sir, I"]}]
    results = []
    for spec in ("off", "ngram"):
        with TestClient(make_app(Path(SHAKESPEARE), speculative=spec, warmup=False)) as client:
            wait_ready(client.get)
            got = []
            for body in bodies:
                r = client.post("/v1/completions", json=body).json()["choices"][0]
                events = sse_events(client.post("/v1/completions", json=body | {"stream": True}).text)
                streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
                got.append((r["text"], r["finish_reason"], r.get("logprobs"), streamed))
            results.append(got)
            if spec == "ngram":
                assert client.get("/info").json()["engine"]["speculative"]["accepted_tokens"] > 0
    for (text, finish, lp, streamed), (text2, finish2, lp2, streamed2) in zip(*results):
        assert (text, finish, streamed) == (text2, finish2, streamed2)
        assert (lp is None) == (lp2 is None)
        if lp is not None:  # the same tokens and alternatives; log-probabilities from a 1 + k position pass
            assert lp["tokens"] == lp2["tokens"] and [list(t) for t in lp["top_logprobs"]] == \
                [list(t) for t in lp2["top_logprobs"]]
            assert lp["token_logprobs"] == pytest.approx(lp2["token_logprobs"], abs=1e-4)
    assert results[1][2][1] == "stop" and all(g[0] == g[3] for g in results[1])
