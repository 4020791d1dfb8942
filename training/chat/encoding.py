"""One conversation → token ids and which of them are learned (training/finetune.py --task chat).

The conversation is rendered with its chat template, as the server renders a request, and cut into segments
at the assistant messages: for assistant message i, the prompt is render(messages[:i], add_generation_prompt)
and the reply is what render(messages[:i+1]) adds to it (the message and what closes it, e.g. `<|endoftext|>`:
the model learns to stop). Each segment is tokenized on its own, as a served prompt is tokenized and its reply
generated token by token; with the default template that is also the tokenization of the whole text
(model/chat_template.py's SFT_TEMPLATE says why). The reply tokens of a message with weight 1 are learned
(TRL's assistant_only_loss); everything else (system, user, tool results, weight-0 replies, the role tokens of
the prompt) is context only. An assistant's tool calls are part of its reply, so they are learned as replies are.

A template must render a conversation's beginning as a prefix of the whole (every common one does); one that
rewrites earlier turns (e.g. drops old reasoning) cannot be trained on here, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.chat_template import ChatTemplate
from model.tokenizer import Tokenizer


class ChatEncodingError(ValueError):
    """The template cannot be split into prompt and reply segments for this conversation (one line)."""


@dataclass
class Message:
    role: str  # system, user, assistant or tool
    content: str
    weight: int = 1  # assistant messages: 1 learned, 0 context only
    tool_calls: list[dict] | None = None  # assistant messages: OpenAI's calls, arguments as objects (as served)
    tool_call_id: str | None = None  # tool messages

    def as_dict(self) -> dict:
        out: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatEncoder:
    """Renders and tokenizes conversations with one template and tokenizer."""

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer) -> None:
        self.template, self.tokenizer = template, tokenizer

    def segments(self, messages: list[Message], tools: list[dict] | None = None) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, learned) pieces, in order; their concatenation is the whole.
        `tools` (OpenAI's function tools) are rendered as the server renders a request's."""
        plain = [m.as_dict() for m in messages]
        render = lambda msgs, add_generation_prompt: self.template.render(  # noqa: E731
            msgs, add_generation_prompt=add_generation_prompt, tools=tools)
        out: list[tuple[str, bool]] = []
        done = ""  # the text covered so far

        def take(text: str, what: str, learned: bool) -> None:
            nonlocal done
            if not text.startswith(done):
                raise ChatEncodingError(f"the chat template does not render {what} as a continuation of the "
                                        "conversation before it, so its reply tokens cannot be located")
            if len(text) > len(done):
                out.append((text[len(done):], learned))
            done = text

        for i, m in enumerate(messages):
            if m.role != "assistant":
                continue
            take(render(plain[:i], add_generation_prompt=True), f"the prompt of message {i + 1}", False)
            take(render(plain[: i + 1], add_generation_prompt=False), f"assistant message {i + 1}",
                 m.weight == 1)
        take(render(plain, add_generation_prompt=False), "the whole conversation", False)
        return out

    def encode(self, messages: list[Message], tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
        """Token ids of the rendered conversation and, for each, whether it is learned (a target of the loss)."""
        ids: list[int] = []
        learn: list[bool] = []
        for text, learned in self.segments(messages, tools):
            seg = self.tokenizer.encode_chat(text)
            ids += seg
            learn += [learned] * len(seg)
        return ids, learn
