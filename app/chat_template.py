"""Chat messages → one prompt string, the way the ecosystem stores chat formats.

A checkpoint may carry a Jinja `chat_template` (Hugging Face's convention: a `chat_template.jinja` file, or
the `chat_template` key of `tokenizer_config.json`, in the checkpoint directory); it is rendered in a
sandbox with `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and `raise_exception`, as
transformers' `apply_chat_template` does. A base model with none gets the transcript format of the OpenLM
write-up (../shared/seeds/004): `You: ...` / `Model: ...` lines, generation cued with `Model:` and stopped
at the next `You:` — so a model trained on plain text (the bundled Shakespeare one) chats out of the box.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The transcript format: system text first, then one line per turn.
DEFAULT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role in ('system', 'developer') -%}{{ m.content ~ '\\n\\n' }}"
    "{%- elif m.role == 'user' -%}{{ 'You: ' ~ m.content ~ '\\n' }}"
    "{%- else -%}{{ 'Model: ' ~ m.content ~ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}Model:{%- endif -%}"
)
DEFAULT_STOP = ["\nYou:"]


class ChatTemplateError(ValueError):
    """The template cannot be used (at load) or refused these messages (at render); one line."""


@dataclass
class ChatTemplate:
    source: str
    origin: str  # where it came from: a file path, or "default"
    stop: list[str] = field(default_factory=list)  # stop strings every chat request gets
    lstrip_reply: bool = False  # drop the reply's leading whitespace (the transcript cues "Model:", no space)
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template {self.origin}: {type(e).__name__}: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None


def _raise(message: str):
    raise ChatTemplateError(message)


def load_chat_template(checkpoint_dir: str | Path, eos_token: str = "", override: str | Path | None = None
                       ) -> ChatTemplate:
    """The checkpoint's template (or `override`, a .jinja file), else the transcript default."""
    d = Path(checkpoint_dir)
    if override is not None:
        path = Path(override)
        try:
            return ChatTemplate(path.read_text(encoding="utf-8"), str(path), eos_token=eos_token)
        except OSError as e:
            raise ChatTemplateError(f"cannot read chat template {path}: {e.strerror or e}") from None
    jinja_file = d / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"), str(jinja_file), eos_token=eos_token)
    config = d / "tokenizer_config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ChatTemplateError(f"cannot read {config}: {e}") from None
        source = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(source, list):  # transformers also stores a list of named templates
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if isinstance(source, str) and source:
            bos = data.get("bos_token") if isinstance(data.get("bos_token"), str) else ""
            eos = data.get("eos_token") if isinstance(data.get("eos_token"), str) else eos_token
            return ChatTemplate(source, str(config), bos_token=bos, eos_token=eos)
    return ChatTemplate(DEFAULT_TEMPLATE, "default (You: / Model: transcript)", stop=list(DEFAULT_STOP),
                        lstrip_reply=True, eos_token=eos_token)
