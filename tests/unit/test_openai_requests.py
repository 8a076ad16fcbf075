"""OpenAI request bodies -> Triton ``sampling_parameters``, and what is refused with a 400."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from splitserve.openai.errors import APIError
from splitserve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ignored_fields,
)
from splitserve.openai.sampling import (
    chat_max_tokens,
    check_chat,
    completion_prompt,
    message_dicts,
    sampling_parameters,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "p", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def refusal(call: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as info:
        call(*args)
    assert info.value.status == 400
    return info.value


def test_only_the_fields_the_client_set_are_sent() -> None:
    assert sampling_parameters(completion(), None) == {}
    req = completion(
        temperature=0,
        top_p=0.5,
        seed=3,
        stop="END",
        top_k=40,
        min_tokens=2,
        ignore_eos=True,
        repetition_penalty=1.1,
        presence_penalty=0.5,
    )
    assert sampling_parameters(req, 12) == {
        "max_tokens": 12,
        "temperature": 0.0,
        "top_p": 0.5,
        "seed": 3,
        "stop": ["END"],
        "top_k": 40,
        "min_tokens": 2,
        "ignore_eos": True,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
    }
    assert sampling_parameters(completion(stop=["a", "b"]), None) == {"stop": ["a", "b"]}


def test_completion_prompt_forms() -> None:
    assert completion_prompt(completion(prompt="text")) == "text"
    assert completion_prompt(completion(prompt=["text"])) == "text"
    for prompt in (["a", "b"], [1, 2], [[1, 2]]):
        assert refusal(completion_prompt, completion(prompt=prompt)).param == "prompt"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"logit_bias": {"1": 5.0}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"suffix": "x"}, "suffix"),
        ({"logprobs": 1}, "logprobs"),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_completion_refusals(fields: dict[str, Any], param: str) -> None:
    assert refusal(completion_prompt, completion(**fields)).param == param


def test_completion_accepts_trivial_values() -> None:
    completion_prompt(completion(n=1, best_of=1, logit_bias={}, stream=True, stream_options={}))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 3}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"continue_final_message": True}, "continue_final_message"),
    ],
)
def test_chat_refusals(fields: dict[str, Any], param: str) -> None:
    assert refusal(check_chat, chat(**fields)).param == param


def test_chat_accepts() -> None:
    check_chat(chat(tool_choice="none", response_format={"type": "text"}, tools=[]))
    check_chat(chat(add_generation_prompt=False, continue_final_message=True))


def test_max_completion_tokens_wins() -> None:
    assert chat_max_tokens(chat()) is None
    assert chat_max_tokens(chat(max_tokens=5)) == 5
    assert chat_max_tokens(chat(max_tokens=5, max_completion_tokens=7)) == 7


def test_message_content_becomes_one_string() -> None:
    req = chat(
        messages=[
            {"role": "system", "content": "be brief", "name": "rules"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ]
    )
    assert message_dicts(req.messages) == [
        {"role": "system", "content": "be brief", "name": "rules"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]
    image = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert refusal(message_dicts, image.messages).param == "messages[0].content"


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": -0.1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"max_tokens": 0},
        {"n": 0},
        {"top_k": -2},
        {"repetition_penalty": 0},
        {"presence_penalty": 3},
        {"stop": 5},
    ],
)
def test_field_ranges(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        completion(**fields)


def test_empty_messages_are_invalid() -> None:
    with pytest.raises(ValidationError):
        chat(messages=[])


def test_unknown_fields_are_reported() -> None:
    req = completion(return_token_ids=True, stream=True, stream_options={"x": 1})
    assert ignored_fields(req) == ["return_token_ids", "stream_options.x"]
    assert ignored_fields(completion()) == []
