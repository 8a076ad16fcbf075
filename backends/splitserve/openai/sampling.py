"""Turns a validated request body into what the Triton generate models take.

The models read vLLM's ``sampling_parameters`` JSON; a field the client left out is left out
here too, so the server's defaults (vLLM's) apply. What Splitserve cannot do (n > 1, log
probabilities, tools, ...) is refused with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from splitserve.openai.errors import bad_request, unsupported
from splitserve.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)

PASS_THROUGH = (
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "repetition_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
)
TEXT_FORMATS = (None, "text")
TOOL_CHOICES_WITHOUT_TOOLS = (None, "none", "auto")


def check_common(req: SamplingFields) -> None:
    if req.n != 1:
        raise unsupported("n", f"= {req.n} (only 1)")
    if req.logit_bias:
        raise unsupported("logit_bias", "(non-empty)")
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "'stream_options' is only allowed when 'stream' is true", "stream_options"
        )


def sampling_parameters(req: SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    """vLLM-style ``sampling_parameters`` with only the fields the client set."""
    params: dict[str, Any] = {}
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    for name in PASS_THROUGH:
        value = getattr(req, name)
        if value is not None:
            params[name] = value
    if req.stop:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return params


def completion_prompt(req: CompletionRequest) -> str:
    """The one text prompt of a completion request."""
    check_common(req)
    if req.suffix:
        raise unsupported("suffix", "(non-empty)")
    if req.logprobs is not None:
        raise unsupported("logprobs", "(log probabilities)")
    if req.best_of not in (None, 1):
        raise unsupported("best_of", f"= {req.best_of} (only 1)")
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise bad_request(
                "'prompt' must be one string (batched and token-id prompts are not supported)",
                "prompt",
            )
        prompt = prompt[0]
    assert isinstance(prompt, str)
    return prompt


def check_chat(req: ChatCompletionRequest) -> None:
    check_common(req)
    if req.logprobs or req.top_logprobs:
        raise unsupported("logprobs", "(log probabilities)")
    if req.tools:
        raise unsupported("tools", "(tool calling)")
    if req.tool_choice not in TOOL_CHOICES_WITHOUT_TOOLS:
        raise unsupported("tool_choice", "(tool calling)")
    kind = (req.response_format or {}).get("type")
    if kind not in TEXT_FORMATS:
        raise unsupported("response_format", f"of type {kind!r} (only 'text')")
    if req.add_generation_prompt and req.continue_final_message:
        raise bad_request(
            "'add_generation_prompt' and 'continue_final_message' cannot both be true",
            "continue_final_message",
        )


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as a chat template expects them: ``content`` always one string."""
    out = []
    for i, message in enumerate(messages):
        item = message.model_dump(exclude_none=True)
        item["content"] = _content_text(message, i)
        out.append(item)
    return out


def _content_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise unsupported(f"messages[{index}].content", f"part of type {part.type!r}")
        texts.append(part.text)
    return "\n".join(texts)
