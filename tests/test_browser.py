"""The playground page (`GET /`) in a real headless Chromium against a real `python -m app` server.

Needs Python Playwright (`pip install playwright`) and a system Chromium (Debian: `apt-get install chromium`;
`playwright install` is not needed, the system browser is launched by path; set CHROMIUM=/path to pick
another). Without them the tests are skipped with the reason. Run: `python -m pytest tests/test_browser.py -m slow`.
Set PLAYGROUND_SCREENSHOT=/some/file.png to keep the screenshot taken after a generation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import tiny_model, write_byte_ranks

REPO = Path(__file__).resolve().parents[1]
# Slow enough that a long generation is still running when Stop is clicked (a 2-layer 32-wide model
# writes 1000 tokens in about a second on a CPU; this one needs about 2 ms a token, so 2000 tokens ~ 4 s+),
# still small enough to build in a second: 4 layers, 128 wide, 2048 positions.
MODEL = dict(block_size=2048, n_layer=4, n_head=4, n_embd=128)
PROMPT = "To be, or not to be"


def _chromium() -> str | None:
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Python Playwright is not installed (pip install playwright)"
    if os.environ.get("CHROMIUM") and not _chromium():
        return f"CHROMIUM={os.environ['CHROMIUM']} is not an executable"
    if not _chromium():
        return "no chromium executable on PATH (apt-get install chromium, or set CHROMIUM=/path/to/chromium)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


# ------------------------------------------------------------------------------------------ fixtures
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post_json(url: str, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _batch_size(base: str) -> float:
    status, body = _get(base + "/metrics")
    assert status == 200, body[:300]
    m = re.search(r"^gpt_batch_size (\S+)$", body.decode(), re.M)
    assert m, "gpt_batch_size is missing from /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`python -m app` on a free loopback port serving a tiny random byte-level checkpoint; yields the base URL."""
    from model.checkpoint import save_checkpoint
    from model.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("browser")
    ranks = write_byte_ranks(d / "bytes.tiktoken", [b"th", b"he", b" t", b"the"])
    tok = Tokenizer.from_ranks_file(ranks)
    ckpt = save_checkpoint(d / "tiny", tiny_model(0, vocab_size=tok.vocab_size, **MODEL), tok,
                           {"note": "browser test"}, tokenizer_file=ranks)
    port = _free_port()
    log = d / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # TIKTOKEN_CACHE_DIR comes from conftest's os.environ
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", "--checkpoint", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
             "--device", "cpu", "--max-batch-size", "2", "--log-level", "warning"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with status {proc.returncode} before it was ready:\n"
                            f"{log.read_text(errors='replace')[-3000:]}")
            try:
                if _get(base + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not healthy within 60 s:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.25)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def chromium_browser():
    from playwright.sync_api import Error, sync_playwright

    with sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox", "--headless=new"])
        except Error as e:
            pytest.fail(f"Playwright could not launch {_chromium()}: {e}")
        yield b
        b.close()


@pytest.fixture
def playground(chromium_browser, server):
    """A fresh page on the playground; fails the test on any JavaScript error or console error."""
    context = chromium_browser.new_context(viewport={"width": 1200, "height": 820})
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    problems: list[str] = []
    pg.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    # (Chromium also logs every non-2xx response as a console error; those are expected in the error test)
    pg.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
          if m.type == "error" and "Failed to load resource" not in m.text else None)
    pg.goto(server + "/")
    pg.wait_for_function("document.querySelector('#model-info').textContent.includes('params')")
    yield pg
    context.close()
    assert not problems, problems


def _fill_params(pg, max_new_tokens: int, temperature: str, seed: str = "") -> None:
    pg.fill("#prompt", PROMPT)
    pg.fill("#max_new_tokens", str(max_new_tokens))
    pg.fill("#temperature", temperature)
    pg.fill("#top_k", "0")
    pg.fill("#top_p", "1")
    pg.fill("#seed", seed)


def _wait_for_text(pg) -> None:
    """Until the first streamed text shows in #output; fails at once, with the page's message, on an error."""
    pg.wait_for_function("document.querySelector('#output').textContent.length > 0"
                         " || document.querySelector('#status').dataset.state === 'error'")
    if pg.get_attribute("#status", "data-state") == "error":
        pytest.fail(f"the page reports an error instead of streamed text: {pg.inner_text('#status')!r}, "
                    f"{pg.inner_text('#error')!r}")


# ---------------------------------------------------------------------------------------------- tests
def test_page_is_self_contained(server):
    status, body = _get(server + "/")
    html = body.decode()
    assert status == 200 and "<title>gpt-serve playground" in html
    for el in ("prompt", "temperature", "top_k", "top_p", "max_new_tokens", "generate", "stop", "output", "status"):
        assert f'id="{el}"' in html, el
    # offline: no external scripts, styles, fonts or images
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "the page loads something from another host"


def test_generate_streams_into_output(playground, server, tmp_path):
    page = playground
    assert "tiny" in page.inner_text("#model-info")  # checkpoint name from /info
    assert page.is_disabled("#stop")
    _fill_params(page, 48, "0.9", seed="7")
    started = time.monotonic()
    page.click("#generate")
    _wait_for_text(page)
    page.wait_for_selector("#status[data-state=done], #status[data-state=error]")
    took = time.monotonic() - started
    status = page.inner_text("#status")
    assert page.get_attribute("#status", "data-state") == "done", (status, page.inner_text("#error"))
    assert re.search(r"finish reason: (length|eos_token)", status), status
    assert "tok/s" in status and "first token" in status, status
    assert page.is_hidden("#error")
    assert page.is_enabled("#generate") and page.is_disabled("#stop")

    # the streamed text is what the server generates for the same seeded request
    shown = page.eval_on_selector("#output", "el => el.textContent")
    ref = _post_json(server + "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 48, "temperature": 0.9, "top_k": 0, "top_p": 1.0, "seed": 7, "do_sample": True,
        "details": True}})
    assert shown == ref["generated_text"]
    assert f"finish reason: {ref['details']['finish_reason']}" in status
    assert f"{ref['details']['generated_tokens']} token" in status

    shot = Path(os.environ.get("PLAYGROUND_SCREENSHOT") or tmp_path / "playground.png")
    page.screenshot(path=str(shot), full_page=True)
    print(f"\nscreenshot: {shot} (generation took {took:.2f} s in the browser)")


def test_stop_cancels_the_request(playground, server):
    page = playground
    _fill_params(page, 2000, "0")  # greedy: this random model loops without producing <|endoftext|>
    page.click("#generate")
    # Stop is clicked by the page itself as soon as the first text shows: the 2000 tokens take ~2 s, which a round
    # trip per Playwright call on a loaded 2-CPU host sometimes outlasted (the request was done before Stop)
    clicked = page.wait_for_function("""() => {
        const out = document.querySelector('#output'), stop = document.querySelector('#stop');
        if (document.querySelector('#status').dataset.state === 'error') return 'error';
        if (!out.textContent.length) return false;
        const running = !stop.disabled && document.querySelector('#generate').disabled;
        if (running) stop.click();
        return running ? 'clicked' : 'not running';
    }""").json_value()
    assert clicked == "clicked", page.inner_text("#status")
    page.wait_for_selector("#status[data-state=stopped], #status[data-state=done], #status[data-state=error]")
    status = page.inner_text("#status")
    assert page.get_attribute("#status", "data-state") == "stopped", status
    assert "Stopped" in status, status
    assert page.is_enabled("#generate") and page.is_disabled("#stop")

    # the server dropped the request: its KV-cache slot is free again ...
    deadline = time.monotonic() + 10
    while _batch_size(server) != 0:
        assert time.monotonic() < deadline, "gpt_batch_size did not return to 0 after Stop"
        time.sleep(0.1)
    # ... and the page shows no more text
    n = len(page.eval_on_selector("#output", "el => el.textContent"))
    page.wait_for_timeout(500)
    assert len(page.eval_on_selector("#output", "el => el.textContent")) == n
    tokens = int(re.search(r"after (\d+) tokens?", status).group(1))
    assert 0 < tokens < 2000, status


def test_errors_are_shown_and_ctrl_enter_generates(playground):
    page = playground
    _fill_params(page, 8, "-1")  # the server refuses a negative temperature with a 422
    page.focus("#prompt")
    page.keyboard.press("Control+Enter")
    page.wait_for_selector("#status[data-state=error]")
    error = page.inner_text("#error")
    assert page.is_visible("#error")
    assert "422" in error and "validation" in error and "temperature" in error, error

    page.fill("#temperature", "0")
    page.focus("#prompt")
    page.keyboard.press("Control+Enter")
    page.wait_for_selector("#status[data-state=done], #status[data-state=error]")
    assert page.get_attribute("#status", "data-state") == "done", (page.inner_text("#status"),
                                                                   page.inner_text("#error"))
    assert page.is_hidden("#error")


def test_mode_radios_sit_beside_their_labels(playground):
    """Each radio is on the first line of its label, left of the text (not centred on a line of its own)."""
    for value in ("complete", "chat"):
        radio = playground.locator(f'#mode input[value="{value}"]').bounding_box()
        label = playground.locator(f'#mode label:has(input[value="{value}"])').bounding_box()
        assert radio["width"] < 40, radio  # its own size, not the label's width
        assert abs(radio["x"] - label["x"]) < 4, (radio, label)
        assert radio["y"] - label["y"] < 12, (radio, label)  # on the first line of the label
        assert radio["y"] + radio["height"] <= label["y"] + 30, (radio, label)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "act": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["name", "act"], "additionalProperties": False}


def _format(pg, kind: str, value: str | None = None) -> None:
    pg.select_option("#response_format", kind)
    if value is not None:
        pg.fill("#format_value", value)


def _run(pg) -> str:
    pg.click("#generate")
    pg.wait_for_selector("#status[data-state=done], #status[data-state=error]")
    assert pg.get_attribute("#status", "data-state") == "done", (pg.inner_text("#status"), pg.inner_text("#error"))
    return pg.eval_on_selector("#output", "el => el.textContent")


def test_response_format_in_complete_mode(playground):
    page = playground
    assert page.is_hidden("#format_value")
    _fill_params(page, 120, "1", seed="3")
    _format(page, "json_schema", json.dumps(SCHEMA))
    assert page.is_visible("#format_value") and page.is_visible("#format-hint")
    doc = json.loads(_run(page))
    assert set(doc) == {"name", "act"} and 1 <= doc["act"] <= 5 and len(doc["name"]) <= 8
    assert "finish reason: stop_sequence" in page.inner_text("#status")  # the grammar completed
    _format(page, "regex", "[a-e]{3,6}!")
    assert re.fullmatch("[a-e]{3,6}!", _run(page))
    _format(page, "json_object")
    assert page.is_hidden("#format_value")
    text = _run(page)
    assert text.startswith("{")  # any JSON object (the random model may run out of tokens inside a key)
    _format(page, "json_schema", "{not json")
    page.click("#generate")
    page.wait_for_selector("#status[data-state=error]")
    assert "not valid JSON" in page.inner_text("#error")


def test_response_format_in_chat_mode(playground):
    page = playground
    page.check('#mode input[value="chat"]')
    _fill_params(page, 120, "1", seed="5")
    _format(page, "json_schema", json.dumps(SCHEMA))
    out = _run(page)
    assert out.startswith("You: " + PROMPT + "\nModel: "), out
    doc = json.loads(out.split("\nModel: ", 1)[1])
    assert set(doc) == {"name", "act"} and 1 <= doc["act"] <= 5
    page.fill("#prompt", "again")
    _format(page, "regex", "(yes|no), my lord")
    out = _run(page)
    assert re.fullmatch("(yes|no), my lord", out.rsplit("\nModel: ", 1)[1]), out
    _format(page, "regex", "((")  # the server's 400 names the field
    page.fill("#prompt", "once more")
    page.click("#generate")
    page.wait_for_selector("#status[data-state=error]")
    assert "structured_outputs.regex" in page.inner_text("#error")
