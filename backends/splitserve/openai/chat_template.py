"""Chat messages -> prompt text, with the checkpoint's Jinja chat template.

The template comes from (first found) ``--chat-template`` (a file or the template itself),
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates: "default"),
``chat_template.jinja``, or ``chat_template.json``. Without one (base models, the built-in tiny
model) the documented fallback ``FALLBACK_TEMPLATE`` renders ``Role: content`` lines and ends with
``Assistant:``.

The server's tokenizer adds BOS itself, so a template's leading BOS text is dropped once, as
vLLM does by tokenizing chat prompts without special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from splitserve.openai.errors import bad_request

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(token: str | Mapping[str, Any] | None) -> str | None:
    if isinstance(token, Mapping):
        return token.get("content")
    return token


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _named(template: str | list[dict[str, str]] | None) -> str | None:
    if isinstance(template, list):
        by_name = {t.get("name"): t.get("template") for t in template}
        return by_name.get("default") or next(iter(by_name.values()), None)
    return template


def find_template(model_dir: Path | None, override: str | None) -> str | None:
    """The template source, or None when neither the override nor the checkpoint has one."""
    if override:
        path = Path(override)
        return path.read_text() if path.is_file() else override
    if model_dir is None:
        return None
    found = _named(_read_json(model_dir / "tokenizer_config.json").get("chat_template"))
    if found:
        return found
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    return _named(_read_json(model_dir / "chat_template.json").get("chat_template"))


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    strip_bos: bool = True
    is_fallback: bool = False

    @cached_property
    def template(self) -> Template:
        return _environment().from_string(self.source)

    @classmethod
    def load(
        cls, model_dir: Path | None, override: str | None = None, strip_bos: bool = True
    ) -> ChatTemplate:
        config = _read_json(model_dir / "tokenizer_config.json") if model_dir else {}
        source = find_template(model_dir, override)
        return cls(
            source=source or FALLBACK_TEMPLATE,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            strip_bos=strip_bos,
            is_fallback=source is None,
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text; a template error (such as its ``raise_exception``) is a 400."""
        variables = {
            **(extra or {}),
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
        }
        try:
            text = self.template.render(**variables)
        except TemplateError as exc:
            raise bad_request(f"chat template: {exc}", "messages") from None
        if continue_final_message:
            text = _cut_after_final(text, messages[-1].get("content", ""))
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text


def _cut_after_final(text: str, final: str) -> str:
    """End the prompt right after the last message's content, so the model continues it."""
    at = text.rfind(final) if final else -1
    return text[: at + len(final)] if at >= 0 else text
