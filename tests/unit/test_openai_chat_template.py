"""Chat templates: from the checkpoint's files, the override, the fallback; BOS handling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.openai.chat_template import FALLBACK_TEMPLATE, ChatTemplate
from splitserve.openai.errors import APIError
from splitserve.openai.served_model import ModelInfo
from splitserve.tokenizer import ByteTokenizer

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def checkpoint(tmp_path: Path, **config: object) -> Path:
    base = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return tmp_path


def test_template_of_tokenizer_config(tmp_path: Path) -> None:
    template = ChatTemplate.load(checkpoint(tmp_path, chat_template=TEMPLATE))
    assert not template.is_fallback
    assert template.render(MESSAGES) == "[user]Hi</s>[assistant]Hello</s>[assistant]"
    keep_bos = ChatTemplate.load(checkpoint(tmp_path, chat_template=TEMPLATE), strip_bos=False)
    assert keep_bos.render(MESSAGES, add_generation_prompt=False) == (
        "<s>[user]Hi</s>[assistant]Hello</s>"
    )


def test_named_templates_and_separate_files(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    assert ChatTemplate.load(checkpoint(tmp_path, chat_template=named)).source == "plain"
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert ChatTemplate.load(tmp_path).source == "from json"
    (tmp_path / "chat_template.jinja").write_text("from jinja")
    assert ChatTemplate.load(tmp_path).source == "from jinja"


def test_override_is_a_file_or_the_template(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path, chat_template=TEMPLATE)
    assert ChatTemplate.load(ckpt, "{{ messages[0]['content'] }}").render(MESSAGES) == "Hi"
    path = tmp_path / "t.jinja"
    path.write_text("file")
    assert ChatTemplate.load(ckpt, str(path)).render(MESSAGES) == "file"


def test_fallback(tmp_path: Path) -> None:
    for template in (ChatTemplate.load(None), ChatTemplate.load(checkpoint(tmp_path))):
        assert template.is_fallback and template.source == FALLBACK_TEMPLATE
        assert template.render(MESSAGES) == "User: Hi\nAssistant: Hello\nAssistant:"
        assert template.render(MESSAGES, add_generation_prompt=False).endswith("Hello\n")


def test_continue_final_message(tmp_path: Path) -> None:
    template = ChatTemplate.load(checkpoint(tmp_path, chat_template=TEMPLATE))
    text = template.render(MESSAGES, add_generation_prompt=False, continue_final_message=True)
    assert text == "[user]Hi</s>[assistant]Hello"


def test_template_helpers_and_errors(tmp_path: Path) -> None:
    source = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    )
    with pytest.raises(APIError, match="system first") as info:
        ChatTemplate.load(None, source).render(MESSAGES)
    assert info.value.status == 400
    tojson = ChatTemplate.load(None, "{{ messages[0] | tojson }}|{{ extra }}")
    assert tojson.render([{"role": "user", "content": "é"}], extra={"extra": 1}) == (
        '{"role": "user", "content": "é"}|1'
    )
    loops = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
    assert ChatTemplate.load(None, loops + "{% endfor %}").render(MESSAGES) == "user"


def test_default_max_tokens_is_the_rest_of_the_context() -> None:
    info = ModelInfo(None, 16, ByteTokenizer(), ChatTemplate.load(None))
    assert info.default_max_tokens("abcd") == 16 - 5  # BOS + 4 bytes
    with pytest.raises(APIError) as error:
        info.default_max_tokens("x" * 15)
    assert error.value.status == 400
    unknown = ModelInfo(None, None, ByteTokenizer(), ChatTemplate.load(None))
    assert unknown.default_max_tokens("abcd") is None
