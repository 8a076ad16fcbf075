import json

import numpy as np
import pytest

from splitserve.serving.inputs import InputError, parse_generate


def b(text: str) -> np.ndarray:
    return np.array([text.encode()], dtype=object)


def test_vllm_style_request():
    req = parse_generate(
        {
            "text_input": b("hi"),
            "stream": np.array([True]),
            "sampling_parameters": b(
                json.dumps({"temperature": 0, "max_tokens": 7, "stop": ["x"]})
            ),
        }
    )
    assert req.prompt == "hi" and req.stream and not req.prepend_prompt
    assert req.params.max_tokens == 7 and req.params.temperature == 0.0 and req.params.stop == ["x"]


def test_tensorrt_llm_style_request():
    req = parse_generate(
        {
            "text_input": np.array([[b"hi"]], dtype=object),
            "max_tokens": np.array([[5]], dtype=np.int32),
            "min_length": np.array([[2]], dtype=np.int32),
            "random_seed": np.array([[9]], dtype=np.uint64),
            "top_k": np.array([[3]], dtype=np.int32),
            "temperature": np.array([[0.5]], dtype=np.float32),
            "stop_words": np.array([[b"end", b""]], dtype=object),
            "beam_width": np.array([[1]], dtype=np.int32),
            "exclude_input_in_output": np.array([[True]]),
        }
    )
    p = req.params
    assert (p.max_tokens, p.min_tokens, p.seed, p.top_k, p.stop) == (5, 2, 9, 3, ["end"])
    assert not req.prepend_prompt


def test_non_streaming_prepends_prompt_by_default():
    assert parse_generate({"text_input": b("hi")}).prepend_prompt


@pytest.mark.parametrize(
    ("inputs", "field"),
    [
        ({}, "text_input"),
        ({"text_input": np.array([b"\xff\xfe"], dtype=object)}, "text_input"),
        ({"text_input": b("a"), "sampling_parameters": b("{bad")}, "sampling_parameters"),
        ({"text_input": b("a"), "sampling_parameters": b("[1]")}, "sampling_parameters"),
        ({"text_input": b("a"), "sampling_parameters": b('{"nope": 1}')}, "nope"),
        ({"text_input": b("a"), "sampling_parameters": b('{"max_tokens": "x"}')}, "max_tokens"),
        ({"text_input": b("a"), "max_tokens": np.array([0], dtype=np.int32)}, "max_tokens"),
        ({"text_input": b("a"), "top_p": np.array([1.5], dtype=np.float32)}, "top_p"),
        ({"text_input": b("a"), "beam_width": np.array([2], dtype=np.int32)}, "beam_width"),
        ({"text_input": np.array([b"a", b"b"], dtype=object)}, "text_input"),
    ],
)
def test_bad_inputs_name_the_field(inputs, field):
    with pytest.raises(InputError, match=field):
        parse_generate(inputs)


def test_sampling_values_given_as_strings_are_converted_like_the_vllm_backend():
    raw = {"max_tokens": "8", "min_tokens": "2", "temperature": "0", "ignore_eos": "true", "n": "1"}
    req = parse_generate({"text_input": b("hi"), "sampling_parameters": b(json.dumps(raw))})
    p = req.params
    assert (p.max_tokens, p.min_tokens, p.temperature, p.ignore_eos) == (8, 2, 0.0, True)
    with pytest.raises(InputError, match="max_tokens"):
        parse_generate({"text_input": b("a"), "sampling_parameters": b('{"max_tokens": "x"}')})
