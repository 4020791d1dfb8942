"""TrainConfig: every training knob, loaded from a JSON/TOML file plus `--set key=value` overrides.

Precedence (later wins): field defaults < config file < `--set` overrides.
TrainConfig is a pydantic model in strict mode: every value is type-checked against the field's annotation
(an int is accepted for a float field, nothing else is coerced), then the ranges are checked together; an
unknown key is an error that names the key and suggests the closest known one, so a typo never silently
falls back to a default. Every problem surfaces as one ConfigError line.
FinetuneConfig (training/finetune.py's knobs) extends it with the fine-tuning keys and defaults.
"""

from __future__ import annotations

import difflib
import functools
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, TypeAdapter, ValidationError, model_validator

from model.device import device_name, dtype_name

_TRAIN_DTYPES = {"auto": "auto", "fp32": "float32", "bf16": "bfloat16"}


class ConfigError(ValueError):
    """A bad config file, key or value; the message names the problem (shown to the user without a traceback)."""


# Keys that shape the model's weights: they must match when resuming or fine-tuning.
ARCH_KEYS = ("n_layer", "n_head", "n_embd", "bias", "norm", "activation", "position")
# Keys of GPTConfig that TrainConfig sets (vocab_size comes from the data's tokenizer).
MODEL_KEYS = ARCH_KEYS + ("block_size", "dropout")


class TrainConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", validate_assignment=False)

    # --- model (GPTConfig; vocab_size comes from the data's tokenizer) ---
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    block_size: int = 256
    dropout: float = 0.1
    bias: bool = True
    norm: Literal["pre", "post"] = "pre"
    activation: Literal["gelu", "relu"] = "gelu"
    position: Literal["learned", "sinusoidal"] = "learned"
    # pad the embedding/head rows up to a multiple of this (64 helps GPU matmuls); 1 = exactly the tokenizer's size.
    # Padded rows are never targets; note that samplers must then ignore logits >= the tokenizer's vocab size.
    vocab_multiple: int = 1

    # --- batches ---
    batch_size: int = 16  # sequences per micro-batch, per process
    grad_accum: int = 1  # micro-batches per optimizer step (per process)

    # --- optimizer and schedule ---
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1  # on 2-D weights only (matmuls, embeddings); never on biases or LayerNorm
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global gradient norm; 0 = off
    # muon: torch.optim.Muon on the transformer blocks' 2-D matrices (attention and MLP weights), AdamW (the keys
    # above) on the embedding/head, position table, biases, LayerNorms and a task head (training/optim.py)
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = 0.02  # Muon's peak learning rate, on learning_rate's warmup + cosine schedule
    muon_weight_decay: float = 0.0  # decoupled: each step multiplies the matrices by 1 - lr * muon_weight_decay
    muon_momentum: float = 0.95
    muon_momentum_start: float = 0.85  # the momentum warms up linearly from this over muon_momentum_warmup steps
    muon_momentum_warmup: int = 0
    # torch.optim.Muon's adjust_lr_fn: "original" scales a matrix's lr by sqrt(max(1, rows / cols)),
    # "match_rms_adamw" by 0.2 * sqrt(max(rows, cols)) (then muon_lr is on AdamW's scale)
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "original"
    warmup_iters: int = 100
    lr_decay_iters: int | None = None  # end of the cosine decay; None = max_iters
    max_iters: int = 2000
    max_minutes: float | None = None  # wall-clock budget of this invocation; None = no limit

    # --- evaluation, logging, samples ---
    eval_interval: int = 250  # also evaluates at step 0 and at the last step; each eval writes OUT/last
    eval_iters: int = 20  # batches per split per evaluation (a fixed set of windows, the same every time)
    log_interval: int = 10
    sample_prompt: str = "\n"  # "" = start from <|endoftext|>
    sample_tokens: int = 64  # 0 = no sample at eval
    sample_temperature: float = 0.8
    sample_top_k: int = 50
    tensorboard: bool = False  # also write TensorBoard event files to OUT/tensorboard (needs the tensorboard package)

    # --- system ---
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto: bf16 autocast on CUDA (if supported), fp32 on CPU; bfloat16 on a CPU needs bf16 in hardware (avx512_bf16 /
    # AMX). Either spelling (model.device.dtype_name); held as float32 / bfloat16
    dtype: Literal["auto", "float32", "bfloat16", "fp32", "bf16"] = "auto"
    compile: bool = False  # torch.compile the model
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    peak_tflops: float | None = None  # accelerator peak for MFU; None = guess from the GPU's name

    # keys set by a config file or an override (not left at their default); never set by users
    _explicit: frozenset[str] = PrivateAttr(default=frozenset())

    def __init__(self, _explicit: frozenset[str] | set[str] = frozenset(), **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise _config_error(type(self), e) from None
        self._explicit = frozenset(_explicit)

    @model_validator(mode="after")
    def _check_ranges(self) -> TrainConfig:
        self.dtype = _TRAIN_DTYPES[dtype_name(self.dtype)]
        errs = self.range_errors()
        if errs:
            raise ConfigError("invalid config: " + "; ".join(errs))
        return self

    def range_errors(self) -> list[str]:
        """What is out of range, one phrase per problem (a subclass adds its own)."""
        errs = []
        positive = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "grad_accum", "max_iters",
                    "eval_interval", "eval_iters", "log_interval", "vocab_multiple")
        for k in positive:
            if getattr(self, k) < 1:
                errs.append(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.n_embd % max(self.n_head, 1):
            errs.append(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            errs.append(f"dropout must be in [0, 1), got {self.dropout}")
        if self.learning_rate <= 0 or self.min_lr < 0 or self.min_lr > self.learning_rate:
            errs.append(f"need 0 <= min_lr <= learning_rate and learning_rate > 0 "
                        f"(got learning_rate={self.learning_rate}, min_lr={self.min_lr})")
        for k in ("weight_decay", "grad_clip", "warmup_iters", "sample_tokens", "sample_top_k", "num_threads",
                  "sample_temperature"):
            if getattr(self, k) < 0:
                errs.append(f"{k} must be >= 0, got {getattr(self, k)}")
        if self.muon_lr <= 0:
            errs.append(f"muon_lr must be > 0, got {self.muon_lr}")
        for k in ("muon_weight_decay", "muon_momentum_warmup"):
            if getattr(self, k) < 0:
                errs.append(f"{k} must be >= 0, got {getattr(self, k)}")
        for k in ("beta1", "beta2", "muon_momentum", "muon_momentum_start"):
            if not 0.0 <= getattr(self, k) < 1.0:
                errs.append(f"{k} must be in [0, 1), got {getattr(self, k)}")
        if self.lr_decay_iters is not None and self.lr_decay_iters < 1:
            errs.append(f"lr_decay_iters must be >= 1 or null, got {self.lr_decay_iters}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            errs.append(f"max_minutes must be > 0 or null, got {self.max_minutes}")
        try:
            device_name(self.device)
        except ValueError as e:
            errs.append(str(e))
        return errs

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in type(self).model_fields}

    def replace(self, **changes: Any) -> TrainConfig:
        """A validated copy with some values changed (the explicit keys are kept)."""
        return type(self)(**{**self.to_dict(), **changes}, _explicit=self._explicit)

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.max_iters

    @property
    def explicit(self) -> frozenset[str]:
        """Keys set by a config file or an override (not left at their default)."""
        return self._explicit


def _fields(cls: type[TrainConfig] = TrainConfig) -> dict[str, Any]:
    """Key → annotation, in declaration order."""
    return {k: f.annotation for k, f in cls.model_fields.items()}


@functools.cache
def _adapter(cls: type[TrainConfig], key: str) -> TypeAdapter:
    return TypeAdapter(cls.model_fields[key].annotation, config=ConfigDict(strict=True))


def _unknown(key: str, where: str, cls: type[TrainConfig] = TrainConfig) -> ConfigError:
    close = difflib.get_close_matches(key, list(_fields(cls)), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{where}: unknown config key {key!r}{hint} (known keys: {', '.join(_fields(cls))})")


def _config_error(cls: type[TrainConfig], e: ValidationError) -> ConfigError:
    """pydantic's errors as the one line the CLI shows: ours (ranges) verbatim, type errors as `key must be T`."""
    for err in e.errors():
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, ConfigError):
            return inner
    err = e.errors()[0]
    key = str(err["loc"][0]) if err["loc"] else "config"
    if err["type"] == "extra_forbidden":
        return _unknown(key, "config", cls)
    if key in cls.model_fields:
        return ConfigError(f"config: {key} must be {_type_name(_fields(cls)[key])}, got {err['input']!r}")
    return ConfigError(f"config: {err['msg']}")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def check_value(key: str, value: Any, where: str = "config", cls: type[TrainConfig] = TrainConfig) -> Any:
    """A value of the right type for `key` (pydantic, strict: ints are accepted for float fields), else
    ConfigError."""
    try:
        return _adapter(cls, key).validate_python(value)
    except ValidationError:
        raise ConfigError(f"{where}: {key} must be {_type_name(_fields(cls)[key])}, got {value!r}") from None


def parse_value(key: str, text: str, cls: type[TrainConfig] = TrainConfig) -> Any:
    """Parse the string of a `--set key=value` override into the field's type."""
    tp = _fields(cls)[key]
    options = typing.get_args(tp) if (isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union) \
        else (tp,)
    low = text.strip().lower()
    where = f"--set {key}={text}"
    if type(None) in options and low in ("none", "null", ""):
        return None
    for opt in options:
        if opt is bool:
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
        elif opt is int:
            try:
                return int(text)
            except ValueError:
                pass
        elif opt is float:
            try:
                return float(text)
            except ValueError:
                pass
        elif opt is str:
            return text
        elif typing.get_origin(opt) is Literal and text in typing.get_args(opt):
            return text
    raise ConfigError(f"{where}: {key} must be {_type_name(tp)}, got {text!r}")


def read_config_file(path: str | Path, cls: type[TrainConfig] = TrainConfig) -> dict[str, Any]:
    """Keys and type-checked values of a .json or .toml config file (a "//"-free flat object)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        elif path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
        else:
            raise ConfigError(f"{path}: config file must end in .json or .toml")
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot parse config file ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object / TOML table of key = value")
    known = _fields(cls)
    out = {}
    for k, v in data.items():
        if k.startswith("_") or k.startswith("#"):  # "_comment" / "#" keys document a JSON config
            continue
        if k not in known:
            raise _unknown(k, str(path), cls)
        out[k] = check_value(k, v, str(path), cls)
    return out


def parse_overrides(items: list[str], cls: type[TrainConfig] = TrainConfig) -> dict[str, Any]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item}: expected key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        if key not in _fields(cls):
            raise _unknown(key, f"--set {item}", cls)
        out[key] = parse_value(key, text, cls)
    return out


def build_config(base: dict[str, Any] | None = None, file: str | Path | None = None,
                 overrides: list[str] | None = None, cls: type[TrainConfig] = TrainConfig) -> TrainConfig:
    """defaults < base (e.g. a resumed run's saved config) < file < overrides, as a `cls`."""
    values: dict[str, Any] = {}
    explicit: set[str] = set()
    if base:
        for k, v in base.items():
            if k not in _fields(cls):
                raise _unknown(k, "saved config", cls)
            values[k] = check_value(k, v, "saved config", cls)
        explicit |= set(base)
    if file is not None:
        from_file = read_config_file(file, cls)
        values.update(from_file)
        explicit |= set(from_file)
    if overrides:
        over = parse_overrides(overrides, cls)
        values.update(over)
        explicit |= set(over)
    return cls(**values, _explicit=frozenset(explicit))


class FinetuneConfig(TrainConfig):
    """TrainConfig plus the keys of supervised task fine-tuning (training/finetune.py), with defaults for a
    pre-trained body and a fresh task head (GPT-1 used lr 6.25e-5, batch 32, λ = 0.5, 3 epochs)."""

    # L = L_task + lm_weight · L_LM, the language-modelling loss on the same sequences' text tokens
    lm_weight: float = 0.5
    eval_examples: int = 0  # validation examples per evaluation (the first N of the file); 0 = all
    learning_rate: float = 1e-4
    min_lr: float = 1e-5
    weight_decay: float = 0.01
    warmup_iters: int = 20
    max_iters: int = 300
    eval_interval: int = 50
    sample_tokens: int = 0  # a short sample per evaluation shows the body still generates; 0 = none
    # --task chat: a conversation longer than block_size + 1 tokens is dropped, or cut to its first block_size + 1
    # (training/chat/data.py); either is counted in the log
    overlong: Literal["drop", "truncate"] = "drop"

    def range_errors(self) -> list[str]:
        errs = super().range_errors()
        for k in ("lm_weight", "eval_examples"):
            if getattr(self, k) < 0:
                errs.append(f"{k} must be >= 0, got {getattr(self, k)}")
        return errs
