"""Parse a generate request in the vLLM-backend and TensorRT-LLM-backend conventions.

Tensors arrive as numpy arrays keyed by input name. Every problem raises ``InputError`` naming
the field, which the Triton adapter turns into ``INVALID_ARG``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from splitserve.engine.sampling_params import SamplingParams


class InputError(ValueError):
    """A request field is missing or malformed."""


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    prepend_prompt: bool
    return_finish_reason: bool
    return_num_input_tokens: bool
    return_num_output_tokens: bool
    timeout_s: float | None = None
    """The request's own time limit from ``timeout``/``deadline_ms``; None if it gave none."""


SAMPLING_TYPES = {f.name: str(f.type) for f in fields(SamplingParams)}
# Tensor inputs (TensorRT-LLM backend names first) -> SamplingParams field.
TENSOR_PARAMS: dict[str, str] = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "runtime_top_k": "top_k",
    "runtime_top_p": "top_p",
    "seed": "seed",
    "random_seed": "seed",
    "min_tokens": "min_tokens",
    "min_length": "min_tokens",
    "ignore_eos": "ignore_eos",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "stop": "stop",
    "stop_words": "stop",
}
DEADLINE_TYPES = {"timeout": "float", "deadline_ms": "int"}
"""``sampling_parameters`` keys that limit a request's time (seconds, milliseconds) rather than
its sampling; one of them at most."""
# Accepted for compatibility only at the value that means "one plain sample".
TRIVIAL_VALUES: dict[str, Any] = {"n": 1, "best_of": 1, "use_beam_search": False, "beam_width": 1}


def _scalar(name: str, arr: np.ndarray) -> Any:
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise InputError(f"input '{name}' must hold exactly one element, got shape {arr.shape}")
    value = flat[0]
    return value.item() if isinstance(value, np.generic) else value


def _text(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, bytes | bytearray):
        raise InputError(f"input '{name}' must be BYTES (UTF-8 text)")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"input '{name}' is not valid UTF-8: {exc.reason} at byte {exc.start}"
        ) from None


def _strings(name: str, arr: np.ndarray) -> list[str]:
    return [_text(name, v) for v in np.asarray(arr).reshape(-1) if v not in (b"", "")]


def _sampling_json(raw: Any) -> dict[str, Any]:
    text = _text("sampling_parameters", raw)
    if not text.strip():
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"input 'sampling_parameters' is not valid JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise InputError("input 'sampling_parameters' must be a JSON object")
    return obj


def _from_string(key: str, value: Any) -> Any:
    """Numbers and booleans given as JSON strings (genai-perf sends ``"max_tokens": "8"``),
    converted as Triton's vLLM backend does; other values pass through unchanged."""
    kind = (
        SAMPLING_TYPES.get(key) or DEADLINE_TYPES.get(key) or type(TRIVIAL_VALUES.get(key)).__name__
    )
    if not isinstance(value, str) or kind not in ("int", "int | None", "float", "bool"):
        return value
    text = value.strip()
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        return float(text) if kind == "float" else int(text)
    except ValueError:
        raise InputError(f"sampling_parameters '{key}': cannot read {value!r} as {kind}") from None


def _check_trivial(key: str, value: Any, source: str) -> None:
    if value != TRIVIAL_VALUES[key]:
        raise InputError(
            f"{source} '{key}'={value!r} is not supported (only {TRIVIAL_VALUES[key]!r})"
        )


def _timeout_s(given: dict[str, Any]) -> float | None:
    """Seconds from ``timeout`` or ``deadline_ms`` (positive, finite), None if neither is given."""
    if len(given) > 1:
        raise InputError("sampling_parameters: give 'timeout' or 'deadline_ms', not both")
    if not given:
        return None
    ((key, value),) = given.items()
    millis = key == "deadline_ms"
    seconds = math.nan
    if isinstance(value, int if millis else int | float) and not isinstance(value, bool):
        try:
            seconds = value / 1000 if millis else float(value)
        except OverflowError:  # an integer past any float
            seconds = math.inf
    if not 0 < seconds < math.inf:
        unit = "milliseconds (an integer)" if millis else "seconds"
        raise InputError(
            f"sampling_parameters '{key}' must be a positive, finite number of {unit}, "
            f"got {value!r}"
        )
    return seconds


def parse_generate(
    inputs: Mapping[str, np.ndarray], default_max_tokens: int = 16
) -> GenerateRequest:
    if "text_input" not in inputs:
        raise InputError("input 'text_input' is required")
    prompt = _text("text_input", _scalar("text_input", inputs["text_input"]))
    kwargs: dict[str, Any] = {"max_tokens": default_max_tokens}
    deadline: dict[str, Any] = {}
    if "sampling_parameters" in inputs:
        for key, value in _sampling_json(
            _scalar("sampling_parameters", inputs["sampling_parameters"])
        ).items():
            value = _from_string(key, value)
            if key in TRIVIAL_VALUES:
                _check_trivial(key, value, "sampling_parameters")
            elif key in SAMPLING_TYPES:
                kwargs[key] = value
            elif key in DEADLINE_TYPES:
                deadline[key] = value
            else:
                raise InputError(f"sampling_parameters key '{key}' is not supported")
    for name, field in TENSOR_PARAMS.items():
        if name in inputs:
            kwargs[field] = (
                _strings(name, inputs[name]) if field == "stop" else _scalar(name, inputs[name])
            )
    if "beam_width" in inputs:
        _check_trivial("beam_width", _scalar("beam_width", inputs["beam_width"]), "input")
    try:
        params = SamplingParams(**kwargs)
    except ValueError as exc:
        raise InputError(str(exc)) from None

    def flag(name: str, default: bool) -> bool:
        return bool(_scalar(name, inputs[name])) if name in inputs else default

    stream = flag("stream", False)
    return GenerateRequest(
        prompt=prompt,
        params=params,
        stream=stream,
        prepend_prompt=not stream and not flag("exclude_input_in_output", False),
        return_finish_reason=flag("return_finish_reason", True),
        return_num_input_tokens=flag("return_num_input_tokens", True),
        return_num_output_tokens=flag("return_num_output_tokens", True),
        timeout_s=_timeout_s(deadline),
    )
