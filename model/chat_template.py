"""Chat messages → one prompt string, the way the ecosystem stores chat formats.

A checkpoint may carry a Jinja `chat_template` (Hugging Face's convention: a `chat_template.jinja` file, or
the `chat_template` key of `tokenizer_config.json`, in the checkpoint directory); it is rendered in a
sandbox with `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and `raise_exception`, as
transformers' `apply_chat_template` does. Its stop tokens are the `eos_token_id` list of the checkpoint's
`generation_config.json` (HF's convention, read by vLLM too): every one but `<|endoftext|>` (where the engine
stops anyway) becomes a stop string of every chat request. A base model with no template gets the transcript
format of the OpenLM write-up (../shared/seeds/004): `You: ...` / `Model: ...` lines, generation cued with
`Model:` and stopped at the next `You:` — so a model trained on plain text (the bundled Shakespeare one) chats
out of the box.

`tools=` (OpenAI's function tools, as transformers' apply_chat_template passes them) reach the template too; a
template that reads `tools` can show them to the model (`renders_tools`).

Chat fine-tuning (training/finetune.py --task chat) renders conversations with SFT_TEMPLATE unless given
another template: role tokens `<|system|>`, `<|user|>`, `<|assistant|>` (special tokens the fine-tune adds to
the tokenizer), the message, and `<|endoftext|>` closing every message, so a reply ends where the engine
already stops. `template_special_tokens` finds the `<|name|>` tokens a template writes; `end_of_turn` which of
them closes an assistant message (the stop token); `chat_config_files` the files a checkpoint carries them in.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import jinja2.meta
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
TRANSCRIPT_ORIGIN = "default (You: / Model: transcript)"  # a checkpoint without a template of its own

# The fine-tuning default (Zephyr's layout): `<|role|>\n` + the trimmed message + eos_token, no newline after it.
# Every boundary between what the model reads and what it learns is a special token or a "\n" before
# non-blank text (trim), both of which split GPT-2's pre-tokenization: a whole conversation tokenizes to the
# concatenation of its parts' tokens, so training sees exactly the ids a served prompt and its reply have.
# Tools (transformers' `tools=`) are Hermes' layout without new special tokens: a system message listing each
# function's JSON, an assistant's calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` lines after
# its text, and a tool's result as a user message in <tool_response> tags; without tools it renders as before.
SFT_TEMPLATE = (
    "{%- if tools -%}{{ '<|system|>\\nYou may call these functions. To call one, answer with "
    "<tool_call>{\\\"name\\\": <name>, \\\"arguments\\\": <arguments>}</tool_call>.' }}"
    "{%- for t in tools -%}{{ '\\n' ~ ((t.function if t.function is defined else t) | tojson) }}{%- endfor -%}"
    "{{ eos_token }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role in ('system', 'developer') -%}{{ '<|system|>\\n' }}"
    "{%- elif m.role in ('user', 'tool') -%}{{ '<|user|>\\n' }}"
    "{%- elif m.role == 'assistant' -%}{{ '<|assistant|>\\n' }}"
    "{%- else -%}{{ raise_exception('unknown role ' ~ m.role ~ ' (expected system, user, assistant or tool)') }}"
    "{%- endif -%}"
    "{%- if m.role == 'tool' -%}{{ '<tool_response>\\n' ~ (m.content | trim) ~ '\\n</tool_response>' }}"
    "{%- else -%}{{ (m.content or '') | trim }}{%- endif -%}"
    "{%- for tc in (m.tool_calls or []) -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{{ ('\\n' if not loop.first or (m.content or '') | trim else '') ~ '<tool_call>' }}"
    "{{ {'name': f.name, 'arguments': f.arguments} | tojson }}{{ '</tool_call>' }}"
    "{%- endfor -%}"
    "{{ eos_token }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)
SFT_ORIGIN = "default (<|role|> tokens, <|endoftext|> ends each message)"
# what a template's special tokens look like (<|im_start|>, <|user|>, <|endoftext|>, ...)
SPECIAL_TOKEN = re.compile(r"<\|[A-Za-z0-9_.:-]+\|>")
TOKENIZER_CONFIG, GENERATION_CONFIG, JINJA_FILE = "tokenizer_config.json", "generation_config.json", \
    "chat_template.jinja"
_PROBE = "\x00probe\x00"  # content no template writes by itself


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
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(self.source)
            # the template reads `tools` (as transformers passes them): it can show functions to the model
            self.renders_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(self.source))
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template {self.origin}: {type(e).__name__}: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
               ) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, tools=tools)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(value, indent=None, separators=None, sort_keys=False):
    """transformers' `tojson` for chat templates: plain JSON (Jinja's own escapes <, >, & and ' for HTML)."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def template_special_tokens(template: ChatTemplate) -> list[str]:
    """The `<|name|>` tokens the template writes, in order of first appearance: those in its source and its
    bos/eos tokens (what a fine-tune adds to the tokenizer when missing)."""
    found = SPECIAL_TOKEN.findall(template.source) + SPECIAL_TOKEN.findall(template.bos_token + template.eos_token)
    return list(dict.fromkeys(found))


def end_of_turn(template: ChatTemplate, special_tokens: list[str]) -> str | None:
    """The special token that closes an assistant message (where generation must stop): the first of
    `special_tokens` in what the template writes right after a reply; None when a reply ends in plain text."""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    text = template.render(probe, add_generation_prompt=False)
    if _PROBE not in text:
        raise ChatTemplateError(f"chat template {template.origin} does not write the assistant's message")
    tail = text[text.index(_PROBE) + len(_PROBE):]
    hits = [(tail.find(t), t) for t in special_tokens if t in tail]
    return min(hits)[1] if hits else None


def chat_config_files(template: ChatTemplate, stop_ids: list[int]) -> dict[str, bytes]:
    """The files a checkpoint carries its chat format in (HF's names): tokenizer_config.json (the template, its
    bos/eos tokens) and generation_config.json (eos_token_id: the ids generation stops at)."""
    config = {"chat_template": template.source, "bos_token": template.bos_token, "eos_token": template.eos_token}
    gen = {"eos_token_id": stop_ids}
    return {TOKENIZER_CONFIG: (json.dumps(config, indent=2) + "\n").encode(),
            GENERATION_CONFIG: (json.dumps(gen, indent=2) + "\n").encode()}


def checkpoint_stop_tokens(checkpoint_dir: str | Path, eos_token: str = "") -> list[str]:
    """The names of the special tokens the checkpoint's generation_config.json stops at, `eos_token` (the
    engine's own stop) left out; ids are looked up in the tokenizer.json spec's special tokens."""
    d = Path(checkpoint_dir)
    try:
        ids = json.loads((d / GENERATION_CONFIG).read_text(encoding="utf-8")).get("eos_token_id")
        special = json.loads((d / "tokenizer.json").read_text(encoding="utf-8")).get("special_tokens") or {}
    except (OSError, ValueError, AttributeError):
        return []
    ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
    return [name for name, i in special.items() if i in ids and name != eos_token]


def load_chat_template(checkpoint_dir: str | Path, eos_token: str = "", override: str | Path | None = None
                       ) -> ChatTemplate:
    """The checkpoint's template (or `override`, a .jinja file), else the transcript default."""
    d = Path(checkpoint_dir)
    stop = checkpoint_stop_tokens(d, eos_token)
    if override is not None:
        path = Path(override)
        try:
            return ChatTemplate(path.read_text(encoding="utf-8"), str(path), stop=stop, eos_token=eos_token)
        except OSError as e:
            raise ChatTemplateError(f"cannot read chat template {path}: {e.strerror or e}") from None
    jinja_file = d / JINJA_FILE
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"), str(jinja_file), stop=stop, eos_token=eos_token)
    config = d / TOKENIZER_CONFIG
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
            return ChatTemplate(source, str(config), stop=stop, bos_token=bos, eos_token=eos)
    return ChatTemplate(DEFAULT_TEMPLATE, TRANSCRIPT_ORIGIN, stop=list(DEFAULT_STOP),
                        lstrip_reply=True, eos_token=eos_token)
