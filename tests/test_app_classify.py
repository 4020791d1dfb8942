"""POST /classify: a checkpoint with a fine-tuned task head answers label probabilities (equal to
Task.predict); one without answers 404 with a clear message."""

from __future__ import annotations

import pytest

from model.checkpoint import load_checkpoint
from model.task_head import load_task
from tests.app_helpers import app_client
from tests.task_fixtures import write_task_checkpoint

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]


def test_classify_answers_with_the_task_head(tmp_path):
    ckpt = write_task_checkpoint(tmp_path / "cls", "classification", ["sad", "happy", "angry"])
    ck = load_checkpoint(ckpt)
    task = load_task(ckpt, ck.model)
    expected = task.predict(ck.model, ck.tokenizer, ["what a day", "oh no"])
    with app_client(ckpt) as c:
        one = c.post("/classify", json={"inputs": "what a day"}).json()
        assert [x["label"] for x in one] == sorted(expected[0], key=lambda k: -expected[0][k])
        assert {x["label"]: x["score"] for x in one} == pytest.approx(expected[0], abs=1e-5)
        assert sum(x["score"] for x in one) == pytest.approx(1.0, abs=1e-5)
        many = c.post("/classify", json={"inputs": ["what a day", "oh no"]}).json()
        assert len(many) == 2 and {x["label"]: x["score"] for x in many[1]} == pytest.approx(expected[1], abs=1e-5)
        r = c.post("/classify", json={"inputs": {"premise": "a", "hypothesis": "b"}})
        assert r.status_code == 422 and r.json()["error"].startswith("inputs:") and "classification" in r.text
        assert c.post("/classify", json={"inputs": []}).status_code == 422
        gen = c.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 3}})
        assert gen.status_code == 200  # a fine-tuned checkpoint still generates


def test_classify_pairs_and_choices(tmp_path):
    with app_client(write_task_checkpoint(tmp_path / "ent", "entailment", ["no", "yes"])) as c:
        pair = c.post("/classify", json={"inputs": ["It rains.", "The street is wet."]}).json()
        named = c.post("/classify", json={"inputs": {"premise": "It rains.", "hypothesis": "The street is wet."}})
        assert {x["label"] for x in pair} == {"no", "yes"} and named.json() == pair
    with app_client(write_task_checkpoint(tmp_path / "mc", "multiple_choice")) as c:
        r = c.post("/classify", json={"inputs": {"context": "To be", "answers": ["or not", "fish", "x"]}}).json()
        assert {x["label"] for x in r} == {"0", "1", "2"} and sum(x["score"] for x in r) == pytest.approx(1, abs=1e-5)


def test_classify_without_a_head_is_404(tiny_ckpt):
    with app_client(tiny_ckpt) as c:
        r = c.post("/classify", json={"inputs": "hello"})
        assert r.status_code == 404
        assert r.json()["error_type"] == "not_found" and "no task head" in r.json()["error"]


def test_corrupt_task_file_refused_at_startup(tmp_path):
    import asyncio

    from app.service import Service, StartupError
    from tests.app_helpers import make_settings

    ckpt = write_task_checkpoint(tmp_path / "bad")
    (ckpt / "task.json").write_text("{broken")
    with pytest.raises(StartupError, match="task.json"):
        asyncio.run(Service(make_settings(ckpt)).startup())
