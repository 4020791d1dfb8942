"""`python -m engine.sample`: streaming output, determinism, clear errors."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from engine.generate import generate
from engine.params import SamplingParams
from model.checkpoint import load_checkpoint, save_checkpoint
from tests.helpers import REPO, tiny_model


@pytest.fixture
def ckpt(tmp_path, byte_tokenizer):
    return save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=264), byte_tokenizer,
                           tokenizer_file=tmp_path / "bytes.tiktoken")


def sample(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.sample", *args], cwd=REPO, capture_output=True,
                          text=True, input=input, timeout=120)


def test_greedy_cli_equals_library(ckpt):
    r = sample("--checkpoint", str(ckpt), "--prompt", "the king", "--max-new-tokens", "12", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    ck = load_checkpoint(ckpt)
    ref = generate(ck.model, ck.tokenizer, [ck.tokenizer.encode("the king")],
                   SamplingParams(max_new_tokens=12, temperature=0))[0]
    assert r.stdout == ref.text + "\n"


def test_seeded_cli_is_reproducible(ckpt):
    args = ["--checkpoint", str(ckpt), "--prompt", "a", "--max-new-tokens", "16", "--seed", "3", "--top-p", "0.9"]
    assert sample(*args).stdout == sample(*args).stdout


def test_interactive_loop(ckpt):
    r = sample("--checkpoint", str(ckpt), "--interactive", "--max-new-tokens", "5", "--temperature", "0",
               input="hello\nhow are you\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("You: ") == 3 and r.stdout.count("Model:") == 2


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "/nonexistent/ck", "--prompt", "x"], "checkpoint directory not found"),
    (["--prompt", "x", "--temperature", "-1"], "temperature must be in"),
    (["--prompt", "x", "--max-new-tokens", "1000"], "exceeds the model's context length"),
    (["--prompt", "x", "--top-p", "0"], "top_p must be in"),
])
def test_cli_errors(ckpt, args, message):
    if "--checkpoint" not in args:
        args = ["--checkpoint", str(ckpt), *args]
    r = sample(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_num_samples_prints_each_sample_on_its_own(ckpt):
    args = ["--checkpoint", str(ckpt), "--prompt", "a", "--max-new-tokens", "8", "--seed", "5"]
    two = sample(*args, "--num-samples", "2")
    assert two.returncode == 0, two.stderr
    first, second = sample(*args), sample(*args[:-1], "6")
    assert two.stdout == first.stdout + second.stdout


def test_piping_into_head_stops_quietly(ckpt):
    """`python -m engine.sample ... | head -n 1`: the reader goes away mid-stream; no traceback, no noise."""
    proc = subprocess.Popen([sys.executable, "-m", "engine.sample", "--checkpoint", str(ckpt), "--prompt", "a",
                             "--max-new-tokens", "32", "--num-samples", "5000", "--device", "cpu"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().endswith(b"\n")
        proc.stdout.close()  # like `head` exiting after its first line, while the CLI has far more to write
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert err == b""
    assert proc.returncode in (0, 141, -signal.SIGPIPE)


def test_help_shows_every_default():
    from engine.sample import build_parser

    r = sample("--help")
    assert r.returncode == 0, r.stderr
    blocks: dict[str, str] = {}  # first option string → its entry in the help, wrapped lines joined
    current = None
    for line in r.stdout.splitlines():
        if re.match(r"\s{2}-", line):
            current = line.split()[0].rstrip(",")
            blocks[current] = line
        elif current and line.startswith(" " * 4):
            blocks[current] += " " + line.strip()
        else:
            current = None
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
        entry = blocks[action.option_strings[0]]
        if action.default not in (None, argparse.SUPPRESS):
            assert "(default: " in entry, entry


class _Chat:
    """The `--interactive` CLI in a subprocess, its stdout read as it arrives."""

    # Each reply is the real model's tokens, then text that never ends: only an interruption can stop it.
    # The generator reports on stderr when it is closed, i.e. when generation has really stopped.
    DRIVER = """if True:
        import signal, sys, time
        # a terminal's Ctrl-C: Python leaves SIGINT ignored when it starts with it ignored (inherited from the
        # process that ran the test suite, e.g. a CI runner), and then no Ctrl-C would reach the chat
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import engine.sample as cli
        from engine.sequence import TokenEvent
        real = cli.stream_generate
        def endless(*args, **kwargs):
            try:
                for item in real(*args, **kwargs):
                    time.sleep(0.005)
                    yield item
                while True:
                    time.sleep(0.005)
                    yield 0, TokenEvent(0, " la", 0.0)
            finally:
                print("[generation stopped]", file=sys.stderr)
        cli.stream_generate = endless
        sys.exit(cli.main(sys.argv[1:]))
    """

    def __init__(self, ckpt):
        self.proc = subprocess.Popen([sys.executable, "-u", "-c", self.DRIVER, "--checkpoint", str(ckpt),
                                      "--interactive", "--max-new-tokens", "60", "--device", "cpu"],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.out = b""
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        while chunk := os.read(self.proc.stdout.fileno(), 4096):
            with self.cond:
                self.out += chunk
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, predicate, timeout=60.0):
        with self.cond:
            ok = self.cond.wait_for(lambda: predicate(self.out.decode(errors="replace")), timeout)
        assert ok, f"timed out; output so far: {self.out!r}"

    def send(self, text):
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def interrupt_reply(self):
        """Let the current reply get well under way, Ctrl-C it, and wait for the prompt to come back."""
        self.wait_for(lambda out: " la la la" in out.rpartition("You: ")[2])  # this turn's reply, not the last
        n = self.out.count(b"You: ")
        self.proc.send_signal(signal.SIGINT)
        self.wait_for(lambda out: out.count("You: ") > n)
        assert self.proc.poll() is None

    def interrupt_prompt(self):
        """Ctrl-C at the `You:` prompt. A SIGINT that lands after the prompt is written but before the read
        blocks is only handled once the read returns (a window no human hits), so resend until it is seen."""
        for _ in range(20):
            self.proc.send_signal(signal.SIGINT)
            with self.cond:
                if self.cond.wait_for(lambda: self.out.endswith(b"You: \n"), timeout=1):
                    return
        raise AssertionError(f"Ctrl-C at the prompt was not handled; output: {self.out!r}")


@pytest.mark.parametrize("leave", ["eof", "ctrl-c"])
def test_interactive_ctrl_c_stops_the_reply_then_eof_or_ctrl_c_exits(ckpt, leave):
    chat = _Chat(ckpt)
    try:
        chat.wait_for(lambda out: out.startswith("You: "))
        for line in ("hello", "tell me more"):
            chat.send(line + "\n")
            chat.interrupt_reply()
        if leave == "eof":
            chat.proc.stdin.close()
        else:
            chat.interrupt_prompt()
        rc = chat.proc.wait(timeout=30)
        err = chat.proc.stderr.read().decode()
    finally:
        if chat.proc.poll() is None:
            chat.proc.kill()
            chat.proc.wait()
    out = chat.out.decode(errors="replace")
    assert rc == 0, (out, err)
    assert "Traceback" not in out + err, err
    assert err.splitlines() == ["[generation stopped]"] * 2  # each reply's generation ended at its Ctrl-C
    assert out.count("You: ") == 3 and out.count("Model:") == 2
    assert re.search(r"( la)+\nYou: ", out)  # the cut reply ends its line; the prompt follows
