"""TrainConfig: files, overrides, type checks, schedule."""

from __future__ import annotations

import json
import math

import pytest

from training.config import ConfigError, TrainConfig, build_config, parse_overrides
from training.train import lr_at


def test_defaults_file_and_overrides_in_order(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"_comment": "ignored", "n_layer": 6, "dropout": 0.2, "learning_rate": 1}))
    cfg = build_config(file=f, overrides=["dropout=0.3", "compile=true", "lr_decay_iters=null"])
    assert cfg.n_layer == 6 and cfg.dropout == 0.3 and cfg.compile is True and cfg.lr_decay_iters is None
    assert cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)  # an int is fine for a float
    assert cfg.n_head == TrainConfig().n_head
    assert {"n_layer", "dropout", "learning_rate", "compile", "lr_decay_iters"} <= cfg.explicit
    assert "n_head" not in cfg.explicit


def test_toml_config(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('n_embd = 64\nn_head = 2\nnorm = "post"\nmax_minutes = 1.5\nsample_prompt = "ROMEO:"\n')
    cfg = build_config(file=f)
    assert (cfg.n_embd, cfg.n_head, cfg.norm, cfg.max_minutes, cfg.sample_prompt) == (64, 2, "post", 1.5, "ROMEO:")


@pytest.mark.parametrize("item,message", [
    ("n_layers=3", "unknown config key 'n_layers'; did you mean 'n_layer'?"),
    ("n_layer=3.5", "n_layer must be int, got '3.5'"),
    ("bias=maybe", "bias must be bool"),
    ("activation=swish", "activation must be one of 'gelu', 'relu'"),
    ("max_minutes=soon", "max_minutes must be float or null"),
    ("n_layer", "expected key=value"),
])
def test_bad_overrides(item, message):
    with pytest.raises(ConfigError, match=None) as e:
        parse_overrides([item])
    assert message in str(e.value)


@pytest.mark.parametrize("content,message", [
    ('{"n_layer": "4"}', "n_layer must be int, got '4'"),
    ('{"dropout": true}', "dropout must be float"),
    ('{"batchsize": 4}', "unknown config key 'batchsize'; did you mean 'batch_size'?"),
    ("[1, 2]", "expected a JSON object"),
    ("{nope", "cannot parse config file"),
])
def test_bad_files(tmp_path, content, message):
    f = tmp_path / "c.json"
    f.write_text(content)
    with pytest.raises(ConfigError) as e:
        build_config(file=f)
    assert message in str(e.value) and "c.json" in str(e.value)


def test_value_checks():
    with pytest.raises(ConfigError, match="divisible"):
        build_config(overrides=["n_embd=30", "n_head=4"])
    with pytest.raises(ConfigError, match="min_lr"):
        build_config(overrides=["min_lr=1", "learning_rate=0.1"])
    with pytest.raises(ConfigError, match="must end in .json or .toml"):
        build_config(file=__file__)


def test_schedule_warmup_cosine_floor():
    cfg = build_config(overrides=["warmup_iters=10", "max_iters=110", "learning_rate=1.0", "min_lr=0.1"])
    assert lr_at(0, cfg) == pytest.approx(1 / 11)
    assert lr_at(9, cfg) == pytest.approx(10 / 11)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.1 + 0.5 * 0.9)
    assert lr_at(110, cfg) == pytest.approx(0.1) and lr_at(500, cfg) == 0.1
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert math.isclose(lr_at(60, build_config(overrides=["warmup_iters=10", "max_iters=60", "lr_decay_iters=110",
                                                          "learning_rate=1.0", "min_lr=0.1"])), 0.55)
