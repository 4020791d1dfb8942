"""TrainConfig: every training knob, loaded from a JSON/TOML file plus `--set key=value` overrides.

Precedence (later wins): dataclass defaults < config file < `--set` overrides.
Every value is type-checked against the field's annotation; an unknown key is an
error that names the key and suggests the closest known one, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A bad config file, key or value; the message names the problem (shown to the user without a traceback)."""


# Keys that shape the model's weights: they must match when resuming or fine-tuning.
ARCH_KEYS = ("n_layer", "n_head", "n_embd", "bias", "norm", "activation", "position")
# Keys of GPTConfig that TrainConfig sets (vocab_size comes from the data's tokenizer).
MODEL_KEYS = ARCH_KEYS + ("block_size", "dropout")


@dataclass
class TrainConfig:
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
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 autocast on CUDA (if supported), fp32 on CPU
    compile: bool = False  # torch.compile the model
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    peak_tflops: float | None = None  # accelerator peak for MFU; None = guess from the GPU's name

    # --- extra fields never set by users ---
    _explicit: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
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
        for k in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, k) < 1.0:
                errs.append(f"{k} must be in [0, 1), got {getattr(self, k)}")
        if self.lr_decay_iters is not None and self.lr_decay_iters < 1:
            errs.append(f"lr_decay_iters must be >= 1 or null, got {self.lr_decay_iters}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            errs.append(f"max_minutes must be > 0 or null, got {self.max_minutes}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            errs.append(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if errs:
            raise ConfigError("invalid config: " + "; ".join(errs))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.max_iters

    @property
    def explicit(self) -> frozenset[str]:
        """Keys set by a config file or an override (not left at their default)."""
        return self._explicit


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(TrainConfig) if not f.name.startswith("_")}


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _unknown(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(_fields()), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{where}: unknown config key {key!r}{hint} (known keys: {', '.join(_fields())})")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def check_value(key: str, value: Any, where: str = "config") -> Any:
    """A value of the right type for `key` (ints are accepted for float fields), else ConfigError."""
    tp = _hints()[key]
    options = typing.get_args(tp) if (isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union) \
        else (tp,)
    for opt in options:
        if opt is type(None) and value is None:
            return None
        if typing.get_origin(opt) is Literal and value in typing.get_args(opt) and isinstance(value, str):
            return value
        if opt is bool and isinstance(value, bool):
            return value
        if opt is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if opt is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if opt is str and isinstance(value, str):
            return value
    raise ConfigError(f"{where}: {key} must be {_type_name(tp)}, got {value!r}")


def parse_value(key: str, text: str) -> Any:
    """Parse the string of a `--set key=value` override into the field's type."""
    tp = _hints()[key]
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


def read_config_file(path: str | Path) -> dict[str, Any]:
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
    known = _fields()
    out = {}
    for k, v in data.items():
        if k.startswith("_") or k.startswith("#"):  # "_comment" / "#" keys document a JSON config
            continue
        if k not in known:
            raise _unknown(k, str(path))
        out[k] = check_value(k, v, str(path))
    return out


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item}: expected key=value")
        key, text = item.split("=", 1)
        key = key.strip()
        if key not in _fields():
            raise _unknown(key, f"--set {item}")
        out[key] = parse_value(key, text)
    return out


def build_config(base: dict[str, Any] | None = None, file: str | Path | None = None,
                 overrides: list[str] | None = None) -> TrainConfig:
    """defaults < base (e.g. a resumed run's saved config) < file < overrides."""
    values: dict[str, Any] = {}
    explicit: set[str] = set()
    if base:
        for k, v in base.items():
            if k not in _fields():
                raise _unknown(k, "saved config")
            values[k] = check_value(k, v, "saved config")
        explicit |= set(base)
    if file is not None:
        from_file = read_config_file(file)
        values.update(from_file)
        explicit |= set(from_file)
    if overrides:
        over = parse_overrides(overrides)
        values.update(over)
        explicit |= set(over)
    return TrainConfig(**values, _explicit=frozenset(explicit))
