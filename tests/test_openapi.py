"""The OpenAPI document (app/openapi.py): typed operations, every refusal documented, the loaded model's
limits filled in — and, as a slow check, schemathesis against it with all checks, positive and negative data."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from tests.app_helpers import LiveServer, app_client, make_app
from tests.helpers import tiny_model, write_byte_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GENERATION = {"/generate": "TGIRequest", "/generate_stream": "StreamRequest", "/": "CompatRequest",
              "/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}


@pytest.fixture(scope="module")
def schema(tiny_ckpt):
    with app_client(tiny_ckpt, max_new_tokens=50, max_stop_sequences=3, max_top_n_tokens=4) as c:
        yield c.get("/openapi.json").json()


def test_every_generation_route_documents_its_body_and_refusals(schema):
    for path, model in GENERATION.items():
        op = schema["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + model), path
        for status in ("400", "413", "415", "422" if not path.startswith("/v1") else "400", "429", "503"):
            assert status in op["responses"], (path, status)
        error = "OpenAIError" if path.startswith("/v1") else "TGIError"
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(error), path
        assert "text/event-stream" in op["responses"]["200"]["content"], path


def test_model_limits_are_in_the_schema(schema):
    comps = schema["components"]["schemas"]

    def branch(model, field, typ):
        prop = comps[model]["properties"][field]
        return next(b for b in prop.get("anyOf", [prop]) if b.get("type") == typ)

    assert branch("TGIParameters", "max_new_tokens", "integer")["maximum"] == 50
    assert branch("TGIParameters", "top_n_tokens", "integer")["maximum"] == 4
    assert branch("TGIParameters", "stop", "array")["maxItems"] == 3
    assert branch("CompletionRequest", "max_tokens", "integer")["maximum"] == 50
    assert branch("ChatCompletionRequest", "max_completion_tokens", "integer")["maximum"] == 50
    assert branch("ChatCompletionRequest", "top_logprobs", "integer")["maximum"] == 4
    assert branch("ChatCompletionRequest", "stop", "string")["maxLength"] == 256
    assert comps["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 260  # vocab 261
    # accepted only when off: the schema says so
    typical_p = comps["TGIParameters"]["properties"]["typical_p"]
    assert typical_p["minimum"] == typical_p["maximum"] == 1
    assert comps["TGIParameters"]["properties"]["watermark"]["enum"] == [False, None]
    # the scoring and biasing fields: token ids within the vocabulary, the refused combinations stated
    assert branch("CompletionRequest", "prompt_logprobs", "integer")["maximum"] == 4
    assert branch("CompletionRequest", "stop_token_ids", "array")["items"]["maximum"] == 260
    keys = re.compile(branch("ChatCompletionRequest", "logit_bias", "object")["propertyNames"]["pattern"])
    assert [k for k in ("0", "7", "260", "261", "007", "-1", "x") if keys.match(k)] == ["0", "7", "260"]
    assert comps["CompletionRequest"]["then"] == {"required": ["echo"], "properties": {"echo": {"const": True}}}
    assert comps["StreamRequest"]["not"]["properties"]["parameters"]["required"] == ["decoder_input_details"]
    assert comps["TGIRequest"]["not"]["allOf"][0]["properties"]["stream"] == {"const": True}


def test_no_untyped_operation(schema):
    for path, item in schema["paths"].items():
        for method, op in item.items():
            for status, resp in op["responses"].items():
                for media, body in resp.get("content", {}).items():
                    assert body.get("schema") not in ({}, None) or media in ("text/plain", "text/event-stream"), (
                        path, method, status, media)


# ------------------------------------------------------------------------------------------- schemathesis
def _schemathesis() -> list[str]:
    exe = shutil.which("schemathesis") or str(__import__("pathlib").Path(sys.executable).parent / "schemathesis")
    if not shutil.which(exe):
        pytest.skip("schemathesis is not installed (make test-slow installs it)")
    return [exe]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_schemathesis_finds_nothing(tmp_path):
    """All checks, positive and negative data, a fixed seed and a bounded number of examples per operation.

    Token-count limits (a prompt's tokens, prompt + max_new_tokens within the context) are the one thing a JSON
    schema cannot state; so that schema-valid cases fit, this server's model has a 16k context and a 16-token
    generation cap (which the schema states)."""
    from model.checkpoint import save_checkpoint
    from model.tokenizer import Tokenizer

    cmd = _schemathesis()
    ranks = write_byte_ranks(tmp_path / "bytes.tiktoken", [b"th", b"he"])
    tok = Tokenizer.from_ranks_file(ranks)
    model = tiny_model(0, vocab_size=tok.vocab_size, block_size=16384, n_layer=1)
    ckpt = save_checkpoint(tmp_path / "m", model, tok, {}, tokenizer_file=ranks)
    app = make_app(ckpt, max_new_tokens=16, max_batch_size=8, max_queue=1000, request_timeout_s=60)
    with LiveServer(app) as live:
        p = subprocess.run(cmd + ["run", live.url + "/openapi.json", "--checks", "all", "--mode", "all",
                                  "--max-examples", "40", "--seed", "1", "--workers", "2", "--request-timeout", "30",
                                  "--suppress-health-check", "all", "--no-shrink", "--no-color"],
                           capture_output=True, text=True, timeout=840, cwd=tmp_path)
    tail = p.stdout[-6000:]
    assert p.returncode == 0, tail  # schemathesis exits non-zero on any failure or error
    tested = re.search(r"Tested:\s+(\d+)", p.stdout)
    assert tested and int(tested.group(1)) >= 12, tail  # every operation was exercised
