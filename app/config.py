"""Server settings: environment variables `GPT_*`, overridden by `python -m app` flags.

`uvicorn app.main:app` and `python -m app` read the same `Settings`; the CLI passes its
flags as init arguments, which take priority over the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine.sizing import parse_memory
from engine.spec_decode.config import (
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_K,
    DEFAULT_MAX_BATCH,
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
    parse_speculative,
)
from engine.stream_interval import DEFAULT_MS as DEFAULT_STREAM_INTERVAL_MS
from model.device import device_name, dtype_name


class SettingsError(ValueError):
    """Settings that cannot be used; the message is one line per problem."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPT_", extra="ignore", validate_default=True)

    checkpoint: Path = Field(Path("checkpoints/shakespeare"), description="checkpoint directory to serve")
    model_name: str | None = Field(None, description="model id reported by /info and /v1/models "
                                                     "(default: the checkpoint directory's name)")
    host: str = Field("0.0.0.0", description="interface to listen on")
    port: int = Field(8000, ge=1, le=65535)
    device: str = Field("auto", description="auto (CUDA when present, else CPU), cuda, cuda:N or cpu")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="auto: bf16 on a GPU that supports it, and on a CPU with native bf16 (avx512_bf16 / "
                            "AMX) where a timing at load finds it faster (unquantized weights); else fp32")
    api_key: SecretStr | None = Field(None, description="when set, generation routes need "
                                                        "'Authorization: Bearer <key>'")
    max_batch_size: int | None = Field(
        None, ge=1, le=1024, description="KV-cache slots: sequences decoded together (default: as many "
                                         "full-length slots as the KV-cache budget holds, up to 32 on a CPU, 256 on a "
                                         "GPU)")
    kv_cache_memory_fraction: float = Field(0.5, gt=0, le=0.95, description="share of the memory free after "
                                            "loading (GPU, or the CPU's MemAvailable within its cgroup's limit) "
                                            "that the default KV-cache "
                                            "budget takes")
    max_queue: int = Field(128, ge=1, le=100_000, description="requests waiting for a slot; more get 429")
    max_prompt_tokens: int | None = Field(None, ge=1, description="default: the context length - 1")
    max_new_tokens: int | None = Field(None, ge=1, description="cap on max_new_tokens / max_tokens "
                                                               "(default: the context length - 1)")
    default_max_new_tokens: int = Field(100, ge=1, description="/generate's max_new_tokens when not given "
                                                               "(lowered to fit the context)")
    request_timeout_s: float = Field(300.0, gt=0, description="per-request time limit, queueing included")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="request bodies above this get 413")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated allowed origins ('*' for any); empty: no CORS")
    prefill_chunk: int = Field(128, ge=1, description="prompt tokens prefilled per engine step while requests "
                               "decode (they wait at most one chunk between tokens)")
    idle_prefill_chunk: int = Field(2048, ge=1, description="prompt tokens prefilled per engine step while no "
                                    "request decodes (nobody waits; a long prompt in one pass reads the weights once)")
    prefix_cache: bool = Field(True, description="reuse the KV cache of a prompt prefix that a slot already holds "
                               "(a conversation's earlier turns, a shared system prompt); off: every prompt is "
                               "prefilled from scratch")
    prefix_cache_min_tokens: int = Field(16, ge=1, description="shortest prefix worth reusing (matched in whole "
                                         "blocks of 16 tokens, then token by token)")
    prepack_weights: bool = Field(True, description="CPU fp32/bf16: serve each Linear from one copy of its weight "
                                  "in oneDNN's blocked layout, made at load (batched matmuls ~15% faster, no extra "
                                  "memory)")
    quantize: Literal["none", "int8", "int4"] = Field(
        "none", description="weight format made at load (TGI's --quantize): int8 per output channel, int4 in groups "
                            "(see int4_group_size); the tied head and embedding go to int8 with either. Quality and "
                            "speed per format: docs/api.md")
    int4_group_size: Literal[32, 64, 128, 256] = Field(32, description="inputs sharing one int4 scale and zero point "
                                                                       "(32: llama.cpp's q4_0 block)")
    kv_cache_memory: str | None = Field(None, description="KV-cache budget: bytes (4GiB, 512MB) or a fraction of "
                                        "the memory available after loading (default: kv_cache_memory_fraction); "
                                        "the default max_batch_size is the full-length slots it holds (at most 32 on "
                                        "a CPU, 256 on a GPU)")
    kv_cache_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="dtype of the KV cache (auto: the model's); bf16 halves its memory")
    max_stop_sequences: int = Field(16, ge=0)
    max_stop_length: int = Field(256, ge=1, description="characters per stop sequence")
    max_top_n_tokens: int = Field(5, ge=0, description="cap on top_n_tokens / logprobs alternatives")
    shutdown_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long in-flight requests may "
                                                              "take to finish")
    torch_threads: int | None = Field(None, ge=1, le=1024, description="CPU threads for torch ops "
                                                                     "(default: every CPU the core may use)")
    warmup: bool = Field(True, description="run a short generation before /health reports ready")
    engine: Literal["process", "thread"] = Field(
        "process", description="where the engine core runs: its own process (the HTTP front never holds the "
                               "model's GIL), or a thread of the server's process (tests, debugging)")
    api_servers: int = Field(1, ge=1, le=64, description="HTTP front processes sharing the port and one engine core "
                                                        "process (vLLM's --api-server-count)")
    cuda_graphs: bool | None = Field(None, description="decode from CUDA graphs captured at warm-up (default: on "
                                                       "with CUDA; kept only if a replay equals eager decoding)")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="CPU, unquantized weights: decode steps of up to compile_max_batch rows, greedy and "
                            "plain sampled draws inside, compiled ahead of time by AOTInductor in the background "
                            "after start-up (C++ GEMM micro-kernels; swapped in once they equal eager decoding) and "
                            "kept in compile_cache; auto: on for fp32 models (quantized ones, or over a 16-bit KV "
                            "cache, of at most 16M block parameters) where the compile fits in memory, kept where a "
                            "one-row step times faster than eager")
    compile_max_batch: int = Field(1, ge=1, le=64, description="the largest decode batch compiled (--compile on)")
    compile_cache: Path | None = Field(None, description="where compiled decode steps are kept, one folder per "
                                       "weights, CPU, threads and torch version (default ~/.cache/gpt-serve/compiled):"
                                       " a restart loads them in milliseconds instead of compiling")
    chat_template: Path | None = Field(None, description="a Jinja chat template file for /v1/chat/completions "
                                       "(default: the checkpoint's chat_template.jinja or tokenizer_config.json, "
                                       "else the You:/Model: transcript)")
    responses_store: int = Field(256, ge=0, le=100_000, description="responses kept (their conversations, in "
                                 "memory, least recently used dropped) for /v1/responses' previous_response_id")
    tool_call_parser: Literal["hermes", "none"] = Field(
        "hermes", description="how tool_choice auto finds calls in a reply (vLLM's --tool-call-parser): hermes, "
        "<tool_call>{json}</tool_call>; none: auto is refused (required and named functions need no parser)")
    speculative: str = Field("off", description="speculative decoding: off, ngram (prompt lookup: proposes what "
                             "followed the sequence's last n-gram earlier in prompt or output) or draft:CHECKPOINT (a "
                             "smaller model with the same tokenizer proposes greedily). Proposals are verified "
                             "exactly: the tokens are those without speculation, sooner where proposals hold")
    num_speculative_tokens: int = Field(DEFAULT_K, ge=1, le=64, description="most tokens proposed per request "
                                        "and step (fewer for a request whose proposals fail)")
    speculative_ngram_min: int = Field(DEFAULT_NGRAM_MIN, ge=1, description="shortest n-gram prompt lookup matches")
    speculative_ngram_max: int = Field(DEFAULT_NGRAM_MAX, ge=1, description="longest n-gram prompt lookup tries "
                                       "first")
    speculative_max_batch: int = Field(DEFAULT_MAX_BATCH, ge=1, description="no speculation in a step decoding "
                                       "more requests than this (a large batch is compute-bound: extra positions "
                                       "cost more than they save)")
    speculative_draft_p_min: float = Field(DEFAULT_DRAFT_P_MIN, ge=0, lt=1, description="a draft model's proposal "
                                           "ends at a token the draft gives less probability than this (llama.cpp's "
                                           "--draft-p-min)")
    stream_interval_ms: float = Field(DEFAULT_STREAM_INTERVAL_MS, ge=0, le=1000, description="a running "
                                      "request's tokens reach its stream at most this many ms apart, several at a "
                                      "time where decode steps are faster (one message from the engine core per "
                                      "interval, not per step); first and last tokens at once. 0: every step")
    sse_ping_s: float = Field(15.0, ge=0, description="seconds without an event before a stream gets a "
                                                      "': ping' comment (0: never)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return device_name(v)  # model.device: the parser the CLIs and training share

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, v: str) -> str:
        parse_speculative(v)  # SpecError (a ValueError): an unknown method, draft without a checkpoint
        return v.strip()

    @model_validator(mode="after")
    def _ngram_sizes(self) -> Settings:
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(f"speculative_ngram_min ({self.speculative_ngram_min}) must be <= speculative_ngram_max "
                             f"({self.speculative_ngram_max})")
        return self

    @model_validator(mode="after")
    def _fronts_need_a_core_process(self) -> Settings:
        if self.api_servers > 1 and self.engine != "process":
            raise ValueError(f"api_servers ({self.api_servers}) needs engine=process (--api-servers and --engine, env "
                             "GPT_API_SERVERS and GPT_ENGINE): several HTTP fronts share the engine core's process")
        return self

    @field_validator("kv_cache_memory")
    @classmethod
    def _kv_memory(cls, v: str | None) -> str | None:
        parse_memory(v)  # SizingError (a ValueError) names the problem
        return v

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, v):
        return dtype_name(v) if isinstance(v, str) else v  # also torch's spelling: float32, bfloat16, float16

    @field_validator("log_level", "engine", mode="before")
    @classmethod
    def _lower(cls, v):
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _origins(cls, v):
        if isinstance(v, str):
            return [o.strip() for o in v.split(",") if o.strip()]
        return v

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key(cls, v):
        return None if isinstance(v, str) and not v.strip() else v

    def served_model_name(self) -> str:
        return self.model_name or Path(self.checkpoint).resolve().name or "gpt"


def load_settings(**overrides) -> Settings:
    """Settings from the environment plus explicit overrides; raises SettingsError with one line per problem."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        lines = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"])
            if not field:  # a check across settings (a model validator): its message names them
                lines.append(f"invalid settings: {err['msg'].removeprefix('Value error, ')}")
                continue
            flag = field.replace("_", "-")
            lines.append(f"invalid setting {field} (--{flag} or env GPT_{field.upper()}): {err['msg']}")
        raise SettingsError("; ".join(lines)) from None
