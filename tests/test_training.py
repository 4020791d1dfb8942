"""The training pipeline end to end: tokenizer → prepare → train → evaluate, exact resume, crash-safe
checkpoints, 2-process DDP, bits-per-byte by hand, and the CLI error paths.

Everything runs on CPU with tiny models and a tiny generated corpus.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.generate import SamplingParams, generate
from model.checkpoint import TRAINING_STATE, load_checkpoint, save_checkpoint
from tests.helpers import REPO, TINY, make_corpus, tiny_model, write_byte_ranks


def sets(*items: str) -> list[str]:
    out = []
    for item in (*TINY, *items):
        out += ["--set", item]
    return out


def cli(module: str, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} {args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def read_metrics(out: Path, event: str) -> list[dict]:
    return [e for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if e["event"] == event]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    (d / "text.txt").write_text(make_corpus())
    return d / "text.txt"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, corpus) -> Path:
    """A trained tokenizer (CLI) and a prepared data directory (CLI): the start of the pipeline."""
    d = tmp_path_factory.mktemp("data")
    cli("training.tokenizer", "--input", str(corpus), "--vocab-size", "300", "--out", str(d / "tok.tiktoken"),
        "--quiet")
    cli("training.prepare", "--input", str(corpus), "--out", str(d / "prepared"), "--tokenizer",
        str(d / "tok.tiktoken"), "--quiet")
    return d / "prepared"


def train_inprocess(*argv: str) -> int:
    from training.train import main

    return main(["--quiet", *argv])


# --------------------------------------------------------------------------- #
# end to end
# --------------------------------------------------------------------------- #


def test_pipeline_end_to_end(tmp_path, corpus, data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["tokenizer"] == {"type": "tiktoken_file", "file": "tok.tiktoken"}
    assert (data_dir / "tok.tiktoken").is_file()  # the data dir is self-contained
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 300
    total = corpus.stat().st_size
    assert meta["val"]["bytes"] == total - math.floor(total * 0.9) and meta["train"]["bytes"] + meta["val"][
        "bytes"] == total

    out = tmp_path / "run"
    cli("training.train", "--data", str(data_dir), "--out", str(out), *sets("max_iters=12", "eval_interval=6",
                                                                              "sample_prompt=ROMEO:"))
    for f in ("last/model.safetensors", "last/training_state.pt", "best/model.safetensors", "metrics.jsonl",
              "loss.png"):
        assert (out / f).is_file(), f
    assert not (out / "best" / TRAINING_STATE).exists()
    evals = read_metrics(out, "eval")
    assert [e["step"] for e in evals] == [0, 6, 12]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]  # it learns
    for e in evals:  # bits per byte from meta's counts
        assert e["val_bpb"] == pytest.approx(e["val_loss"] * meta["val"]["tokens"] / (meta["val"]["bytes"] *
                                                                                      math.log(2)))
        assert e["sample"].startswith("ROMEO:")
    assert len(read_metrics(out, "train")) == 12

    ck = load_checkpoint(out / "best")
    assert ck.config.vocab_size == 300 and ck.config.n_layer == 2
    assert ck.metadata["step"] == min(evals, key=lambda e: e["val_loss"])["step"]
    seq = generate(ck.model, ck.tokenizer, [ck.tokenizer.encode("ROMEO:")],
                   SamplingParams(max_new_tokens=10, seed=1))[0]
    assert len(seq.tokens) >= 1 and isinstance(seq.text, str)

    val_text = tmp_path / "val.txt"
    raw = corpus.read_bytes()
    val_text.write_bytes(raw[math.floor(len(raw) * 0.9):])
    res = json.loads(cli("training.evaluate", "--checkpoint", str(out / "best"), "--input", str(val_text)).stdout)
    assert res["bytes"] == meta["val"]["bytes"] and res["predicted_tokens"] == res["tokens"] - 1
    assert res["perplexity"] == pytest.approx(math.exp(res["loss"]))
    assert res["bits_per_byte"] == pytest.approx(res["loss"] * res["predicted_tokens"] / (res["bytes"] * math.log(2)))
    assert 0 < res["bits_per_byte"] < 8


# --------------------------------------------------------------------------- #
# exact resume
# --------------------------------------------------------------------------- #


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, data_dir):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ("eval_interval=3", "lr_decay_iters=8")
    assert train_inprocess("--data", str(data_dir), "--out", str(full), *sets("max_iters=8", *common)) == 0
    # "interrupted" after 4 of 8 steps: the schedule still decays over 8 (lr_decay_iters)
    assert train_inprocess("--data", str(data_dir), "--out", str(part), *sets("max_iters=4", *common)) == 0
    state = torch.load(part / "last" / TRAINING_STATE, weights_only=True)
    assert state["step"] == 4 and len(state["rng"]) == 1
    assert train_inprocess("--data", str(data_dir), "--out", str(part), "--resume", "--set", "max_iters=8") == 0

    a, b = read_metrics(full, "train"), read_metrics(part, "train")
    assert [e["step"] for e in b] == list(range(1, 9))  # the resumed log continues, without duplicates
    assert [e["loss"] for e in a] == [e["loss"] for e in b]  # bit-for-bit equal
    assert [e["lr"] for e in a] == [e["lr"] for e in b]
    va = {e["step"]: e["val_loss"] for e in read_metrics(full, "eval")}
    vb = {e["step"]: e["val_loss"] for e in read_metrics(part, "eval")}
    assert va[8] == vb[8] and va[3] == vb[3]
    wa, wb = load_file(full / "last" / "model.safetensors"), load_file(part / "last" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_metrics_after_a_resume_drop_steps_logged_after_the_checkpoint(tmp_path, data_dir):
    out = tmp_path / "run"
    assert train_inprocess("--data", str(data_dir), "--out", str(out), *sets("max_iters=2", "eval_interval=2")) == 0
    with (out / "metrics.jsonl").open("a") as f:  # as if the run had gone on past its checkpoint, then died
        f.write(json.dumps({"event": "train", "step": 3, "loss": 1.0}) + "\n" + '{"event": "tra')
    assert train_inprocess("--data", str(data_dir), "--out", str(out), "--resume", "--set", "max_iters=3") == 0
    steps = [e["step"] for e in read_metrics(out, "train")]
    assert steps == [1, 2, 3] and read_metrics(out, "train")[-1]["loss"] != 1.0


# --------------------------------------------------------------------------- #
# crash during a checkpoint write
# --------------------------------------------------------------------------- #

CRASHER = textwrap.dedent("""
    import os, sys
    import torch
    calls = {"n": 0}
    real_save = torch.save
    def dying_save(obj, f, *a, **k):  # training_state.pt is the last file save_checkpoint writes
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint of OUT/last: write half a file, then die at once
            with open(f, "wb") as fh:
                fh.write(b"half a training state")
            os._exit(17)
        return real_save(obj, f, *a, **k)
    torch.save = dying_save
    from training.train import main
    sys.exit(main(sys.argv[1:]))
""")


def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one_loadable(tmp_path, data_dir):
    out = tmp_path / "run"
    script = tmp_path / "crash.py"
    script.write_text(CRASHER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), "--quiet", "--data", str(data_dir), "--out", str(out),
                           *sets("max_iters=6", "eval_interval=3")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr[-2000:]
    assert list(out.glob(".last.tmp-*")), "the crash should have happened inside save_checkpoint"
    ck = load_checkpoint(out / "last")  # the previous checkpoint, whole
    assert ck.metadata["step"] == 0
    assert torch.load(out / "last" / TRAINING_STATE, weights_only=True)["step"] == 0
    # and the run resumes from it (the stale temp directory is cleaned up)
    assert train_inprocess("--data", str(data_dir), "--out", str(out), "--resume") == 0
    assert load_checkpoint(out / "last").metadata["step"] == 6
    assert not list(out.glob(".last.tmp-*"))


# --------------------------------------------------------------------------- #
# data parallel
# --------------------------------------------------------------------------- #

DDP_WRAPPER = textwrap.dedent("""
    import hashlib, os, sys
    from training.train import build_parser, run
    args = build_parser().parse_args(sys.argv[1:])
    model = run(args)
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode()); h.update(v.detach().cpu().contiguous().numpy().tobytes())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hash.rank" + os.environ["RANK"]), "w") as f:
        f.write(h.hexdigest())
""")


def test_two_process_ddp_keeps_replicas_identical(tmp_path, data_dir):
    out = tmp_path / "ddp"
    script = tmp_path / "ddp_wrapper.py"
    script.write_text(DDP_WRAPPER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), "--quiet", "--data", str(data_dir), "--out", str(out),
                           *sets("max_iters=3", "eval_interval=3")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    h0, h1 = (out / "hash.rank0").read_text(), (out / "hash.rank1").read_text()
    assert h0 == h1  # the same weights on both ranks after the steps
    start = read_metrics(out, "start")[0]
    assert start["world_size"] == 2 and start["tokens_per_step"] == 2 * 4 * 32
    state = torch.load(out / "last" / TRAINING_STATE, weights_only=True)
    assert state["step"] == 3 and len(state["rng"]) == 2  # every rank's RNG state is kept for --resume
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])  # dropout noise differs per rank
    # the trained weights are what rank 0 saved
    h = hashlib.sha256()
    ck = load_checkpoint(out / "last")
    for k, v in sorted(ck.model.state_dict().items()):
        h.update(k.encode())
        h.update(v.contiguous().numpy().tobytes())
    assert h.hexdigest() == h0


def test_ranks_sample_different_batches(data_dir):
    from training.lm.data import BatchSampler, open_data_dir

    data = open_data_dir(data_dir)
    r0, r1 = (BatchSampler(data.train, 32, 4, seed=1, rank=r) for r in (0, 1))
    assert not np.array_equal(r0.offsets(5, 0), r1.offsets(5, 0))
    assert np.array_equal(r0.offsets(5, 0), BatchSampler(data.train, 32, 4, seed=1, rank=0).offsets(5, 0))
    assert not np.array_equal(r0.offsets(5, 0), r0.offsets(5, 1))  # micro-steps differ too


# --------------------------------------------------------------------------- #
# evaluation by hand
# --------------------------------------------------------------------------- #


@pytest.fixture
def tiny_checkpoint(tmp_path, byte_tokenizer):
    model = tiny_model(seed=3, block_size=16)
    return save_checkpoint(tmp_path / "ck", model, byte_tokenizer, tokenizer_file=tmp_path / "bytes.tiktoken")


def hand_nll(model, tokens: list[int], p: int, start: int) -> float:
    """-log P(t_p | t_start .. t_p-1), straight from the model's logits."""
    x = torch.tensor([tokens[start:p]])
    with torch.no_grad():
        logits, _ = model(x)
    return -torch.log_softmax(logits[0, -1].double(), -1)[tokens[p]].item()


@pytest.mark.parametrize("block,stride", [(16, 16), (16, 5), (8, 1), (12, 8)])
def test_evaluate_matches_a_hand_computation(tmp_path, tiny_checkpoint, block, stride):
    from training.evaluate import evaluate

    text = "the theme: the other thing, then the end.\n" * 2
    f = tmp_path / "t.txt"
    f.write_text(text)
    ck = load_checkpoint(tiny_checkpoint)
    toks = ck.tokenizer.encode(text)
    n = len(toks)
    W = min(block, ck.config.block_size)
    expected = 0.0
    for p in range(1, n):  # every token after the first, with the documented context
        if p <= W:
            start = 0
        else:
            start = -(-(p - W) // stride) * stride  # the first window whose end reaches p
            start = min(start, n - 1 - W)  # the last window is moved back to end at the last token
        expected += hand_nll(ck.model, toks, p, start)
    res = evaluate(str(tiny_checkpoint), [str(f)], block_size=W, stride=stride, batch_size=3)
    assert res["tokens"] == n and res["predicted_tokens"] == n - 1 and res["bytes"] == len(text.encode())
    assert res["loss"] == pytest.approx(expected / (n - 1), rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(expected / (n - 1)), rel=1e-5)
    assert res["bits_per_byte"] == pytest.approx(expected / (len(text.encode()) * math.log(2)), rel=1e-5)


@pytest.mark.parametrize("block,stride", [(16, 8), (12, 5)])
def test_evaluate_through_a_kv_cache_scores_as_one_forward_pass_does(tmp_path, tiny_checkpoint, block, stride):
    """--kv-cache-dtype: each window decoded token by token through a cache (the server's compiled decode attention
    on a CPU): an fp32 cache gives the forward pass's loss; a bf16 one rounds the keys and values it stores, a
    little off it (the quality a 16-bit cache costs, measured on the path that serves it)."""
    from training.evaluate import evaluate

    f = tmp_path / "t.txt"
    f.write_text("the theme: the other thing, then the end.\n" * 3)
    kw = dict(block_size=block, stride=stride, batch_size=3)
    plain = evaluate(str(tiny_checkpoint), [str(f)], **kw)
    fp32 = evaluate(str(tiny_checkpoint), [str(f)], kv_cache_dtype="fp32", **kw)
    bf16 = evaluate(str(tiny_checkpoint), [str(f)], kv_cache_dtype="bf16", **kw)
    assert fp32["kv_cache_dtype"] == "fp32" and plain["kv_cache_dtype"] is None
    assert fp32["predicted_tokens"] == bf16["predicted_tokens"] == plain["predicted_tokens"]
    assert fp32["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert bf16["loss"] != fp32["loss"] and bf16["loss"] == pytest.approx(plain["loss"], rel=1e-2)


def test_evaluate_whole_text_in_one_window_equals_the_models_own_loss(tmp_path, tiny_checkpoint):
    from training.evaluate import evaluate

    text = "then the theme"
    f = tmp_path / "t.txt"
    f.write_text(text)
    ck = load_checkpoint(tiny_checkpoint)
    t = torch.tensor([ck.tokenizer.encode(text)])
    assert t.size(1) <= 16
    with torch.no_grad():
        _, loss = ck.model(t[:, :-1], t[:, 1:])
    res = evaluate(str(tiny_checkpoint), [str(f)])
    assert res["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert res["bits_per_byte"] == pytest.approx(loss.item() * (t.size(1) - 1) / (len(text) * math.log(2)), rel=1e-5)


def test_evaluate_windows_cover_every_token_once():
    from training.evaluate import plan_windows

    for n, w, s in [(2, 4, 4), (10, 4, 4), (10, 4, 1), (100, 16, 7), (17, 16, 16), (18, 16, 8)]:
        scored = []
        for a, length, k in plan_windows(n, w, s):
            assert 1 <= length <= w and a >= 0 and a + length <= n - 1
            scored += list(range(a + 1 + k, a + 1 + length))
        assert scored == list(range(1, n)), (n, w, s)


# --------------------------------------------------------------------------- #
# fine-tuning
# --------------------------------------------------------------------------- #


def test_init_from_fine_tunes_and_checks_the_tokenizer(tmp_path, data_dir, corpus, capsys):
    base = tmp_path / "base"
    assert train_inprocess("--data", str(data_dir), "--out", str(base), *sets("max_iters=2", "eval_interval=2")) == 0
    ft = tmp_path / "ft"
    assert train_inprocess("--data", str(data_dir), "--out", str(ft), "--init-from", str(base / "last"),
                           *sets("max_iters=2", "eval_interval=2", "block_size=16")) == 0
    ck = load_checkpoint(ft / "last")
    assert ck.config.block_size == 16 and ck.metadata["init_from"] == str(base / "last")
    start = read_metrics(ft, "eval")[0]
    assert start["val_loss"] < read_metrics(base, "eval")[0]["val_loss"]  # starts from the trained weights

    # data tokenized with another tokenizer → refused
    other = tmp_path / "other"
    from tests.helpers import write_byte_ranks

    write_byte_ranks(tmp_path / "bytes.tiktoken", [b"th", b"he"])
    assert cli("training.prepare", "--input", str(corpus), "--out", str(other), "--tokenizer",
               str(tmp_path / "bytes.tiktoken"), "--quiet").returncode == 0
    capsys.readouterr()
    assert train_inprocess("--data", str(other), "--out", str(tmp_path / "x"), "--init-from",
                           str(base / "last")) == 2
    assert "tokenizer" in capsys.readouterr().err


def test_init_from_a_gpt2_style_checkpoint_with_the_named_tokenizer(tmp_path, corpus, gpt2_tokenizer):
    """An imported GPT-2 checkpoint names r50k_base; data prepared with --tokenizer r50k_base matches it."""
    from training.prepare import prepare

    base = save_checkpoint(tmp_path / "gpt2ish", tiny_model(seed=1, vocab_size=50257, block_size=64), gpt2_tokenizer)
    prepare([str(corpus)], tmp_path / "data", "r50k_base", 0.1, progress=False)
    out = tmp_path / "ft"
    assert train_inprocess("--data", str(tmp_path / "data"), "--out", str(out), "--init-from", str(base),
                           *sets("max_iters=2", "eval_interval=2", "sample_tokens=4")) == 0
    ck = load_checkpoint(out / "last")
    assert ck.tokenizer.spec == {"type": "tiktoken", "name": "r50k_base"}
    assert ck.config.vocab_size == 50257 and ck.config.block_size == 32  # cropped to the run's block_size


# --------------------------------------------------------------------------- #
# CLI errors: a non-zero exit and one line naming the problem, never a traceback
# --------------------------------------------------------------------------- #


def test_prepare_errors(tmp_path):
    def err(*args):
        proc = cli("training.prepare", *args, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        return proc.stderr

    assert "no such file" in err("--input", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o"))
    (tmp_path / "empty.txt").write_text("")
    assert "empty" in err("--input", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o"))
    (tmp_path / "bad.txt").write_bytes(b"hello world\n" * 3 + b"caf\xe9 \xff\n")
    # a ranks file of our own: the check must not depend on GPT-2's ranks (downloaded on first use)
    ranks = str(write_byte_ranks(tmp_path / "bytes.tiktoken"))
    msg = err("--input", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "o"), "--tokenizer", ranks)
    assert "bad.txt" in msg and "byte offset 39" in msg
    assert "val-fraction" in err("--input", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "o"),
                                 "--val-fraction", "1.5")
    assert "not-a-file.tiktoken" in err("--input", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "o"),
                                        "--tokenizer", str(tmp_path / "not-a-file.tiktoken"))
    assert not (tmp_path / "o" / "train.bin").exists()


def test_train_errors(tmp_path, data_dir, capsys):
    def err(*args):
        capsys.readouterr()
        assert train_inprocess(*args) == 2
        return capsys.readouterr().err

    base = ("--data", str(data_dir), "--out", str(tmp_path / "o"))
    assert "unknown config key 'n_layers'; did you mean 'n_layer'" in err(*base, "--set", "n_layers=2")
    assert "n_layer must be int" in err(*base, "--set", "n_layer=two")
    assert "dropout must be in [0, 1)" in err(*base, "--set", "dropout=1.5")
    assert "must be divisible by n_head" in err(*base, "--set", "n_embd=30", "--set", "n_head=4")
    assert "norm must be one of" in err(*base, "--set", "norm=middle")
    bad_cfg = tmp_path / "c.json"
    bad_cfg.write_text('{"lerning_rate": 0.1}')
    assert "c.json: unknown config key 'lerning_rate'" in err(*base, "--config", str(bad_cfg))
    assert "config file not found" in err(*base, "--config", str(tmp_path / "missing.toml"))
    assert "data directory not found" in err("--data", str(tmp_path / "nodata"), "--out", str(tmp_path / "o"))
    assert "nothing to resume" in err(*base, "--resume")
    assert "checkpoint directory not found" in err(*base, "--init-from", str(tmp_path / "nock"))
    assert "needs at least block_size + 1" in err(*base, *sets("block_size=100000"))


def test_bf16_on_a_cpu_autocasts_where_the_cpu_has_it_and_is_refused_in_one_line_where_not(tmp_path, data_dir,
                                                                                            capsys, monkeypatch):
    from model import cpu_support
    from tests.helpers import force_cpu

    base = ("--data", str(data_dir), *sets("max_iters=3", "eval_interval=3"))
    if cpu_support.support().native_bf16:
        assert train_inprocess(*base, "--out", str(tmp_path / "fp32")) == 0
        assert train_inprocess(*base, "--out", str(tmp_path / "bf16"), "--set", "dtype=bfloat16") == 0
        assert read_metrics(tmp_path / "bf16", "start")[0]["bf16"] is True
        assert read_metrics(tmp_path / "fp32", "start")[0]["bf16"] is False
        a, b = (np.array([e["loss"] for e in read_metrics(tmp_path / r, "train")]) for r in ("fp32", "bf16"))
        assert not np.array_equal(a, b)  # the matmuls ran in bf16 ...
        assert np.allclose(a, b, atol=0.05)  # ... and trained the same model
    force_cpu(monkeypatch, packed_bf16=False)  # an AVX2 host's answer
    capsys.readouterr()
    assert train_inprocess(*base, "--out", str(tmp_path / "avx2"), "--set", "dtype=bfloat16") == 2
    err = capsys.readouterr().err.strip()
    assert "dtype=bfloat16 on this CPU: no bf16 in hardware" in err and "use dtype=float32" in err
    assert len(err.splitlines()) == 1


def test_train_cli_error_is_one_line_without_traceback(tmp_path, data_dir):
    proc = cli("training.train", "--data", str(data_dir), "--out", str(tmp_path / "o"), "--set", "max_iter=3",
               check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("python -m training.train: error: ")
    assert "did you mean 'max_iters'" in proc.stderr


def test_evaluate_errors(tmp_path, tiny_checkpoint, capsys):
    from training.evaluate import main

    def err(*args):
        capsys.readouterr()
        assert main(list(args)) == 2
        return capsys.readouterr().err

    (tmp_path / "t.txt").write_text("the end")
    proc = cli("training.evaluate", "--checkpoint", str(tmp_path / "no"), "--input", str(tmp_path / "t.txt"),
               check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "checkpoint directory not found" in proc.stderr and proc.stdout == ""
    (tmp_path / "empty.txt").write_text("")
    assert "input is empty" in err("--checkpoint", str(tiny_checkpoint), "--input", str(tmp_path / "empty.txt"))
    (tmp_path / "bad.txt").write_bytes(b"ok \xc3")
    assert "bad.txt: invalid UTF-8 at byte offset 3" in err("--checkpoint", str(tiny_checkpoint), "--input",
                                                             str(tmp_path / "bad.txt"))
    assert "--stride must be in [1, block size 16]" in err("--checkpoint", str(tiny_checkpoint), "--input",
                                                           str(tmp_path / "t.txt"), "--stride", "17")
    assert "no such file" in err("--checkpoint", str(tiny_checkpoint), "--input", str(tmp_path / "nope.txt"))
    assert "--block-size must be in [1, 16]" in err("--checkpoint", str(tiny_checkpoint), "--input",
                                                    str(tmp_path / "t.txt"), "--block-size", "17")
    with pytest.raises(SystemExit) as e:  # argparse's own one-line error, exit 2
        main(["--checkpoint", str(tiny_checkpoint), "--input", str(tmp_path / "t.txt"), "--kv-cache-dtype", "int8"])
    assert e.value.code == 2 and "--kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err
