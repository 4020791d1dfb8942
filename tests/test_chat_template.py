"""Chat templates: the transcript default, a checkpoint's Jinja template (HF's conventions), refusals."""

from __future__ import annotations

import json

import pytest

from model.chat_template import DEFAULT_STOP, ChatTemplate, ChatTemplateError, load_chat_template

TWO_TURNS = [{"role": "system", "content": "Speak as a Dane."}, {"role": "user", "content": "Who's there?"},
             {"role": "assistant", "content": "Nay, answer me."}, {"role": "user", "content": "Long live the king!"}]


def test_default_is_the_you_model_transcript(tmp_path):
    t = load_chat_template(tmp_path)
    assert t.origin.startswith("default") and t.stop == DEFAULT_STOP == ["\nYou:"] and t.lstrip_reply
    assert t.render(TWO_TURNS) == ("Speak as a Dane.\n\nYou: Who's there?\nModel: Nay, answer me.\n"
                                   "You: Long live the king!\nModel:")
    assert t.render(TWO_TURNS[:2], add_generation_prompt=False) == "Speak as a Dane.\n\nYou: Who's there?\n"


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_checkpoint_jinja_file_wins(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "ignored"}))
    t = load_chat_template(tmp_path)
    assert t.origin.endswith("chat_template.jinja") and t.stop == [] and not t.lstrip_reply
    assert t.render(TWO_TURNS[1:2]) == "<|im_start|>user\nWho's there?<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_config_template_with_special_tokens(tmp_path):
    src = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": src}, {"name": "tool_use", "template": "x"}],
         "bos_token": "<s>", "eos_token": "</s>"}))
    t = load_chat_template(tmp_path)
    assert t.render(TWO_TURNS[1:2]) == "<s>[user] Who's there?</s>"


def test_override_file_and_errors(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}"
                 "{% endif %}{{ messages[0].content }}")
    t = load_chat_template(tmp_path, override=f)
    assert t.render([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        t.render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="cannot read chat template"):
        load_chat_template(tmp_path, override=tmp_path / "missing.jinja")
    with pytest.raises(ChatTemplateError, match="TemplateSyntaxError"):
        ChatTemplate("{% for %}", "bad.jinja")


def test_sandbox_refuses_python_internals():
    t = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", "evil")
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "x"}])
