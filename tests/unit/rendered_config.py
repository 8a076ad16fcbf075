"""Reading a rendered ``config.pbtxt`` back: its one ``splitserve_config`` parameter, unescaped
from the protobuf text format and decoded from JSON (what a stub's ``setup_instance`` reads)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from splitserve.serving.serving_config import CONFIG_PARAMETER, ServingConfig

_ENTRY = re.compile(
    r'\{ key: "(?P<key>[^"]*)" value: \{ string_value: "(?P<value>(?:[^"\\]|\\.)*)" \} \}'
)
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def unescape(body: str) -> str:
    """The text a protobuf text-format string literal (without its quotes) spells: ``\\\\``,
    ``\\"`` and ``\\n``, the escapes ``render.pbtxt_string`` writes; any other is an error."""

    def one(match: re.Match[str]) -> str:
        char = match.group(1)
        assert char in _ESCAPES, f"unexpected escape \\{char} in {body!r}"
        return _ESCAPES[char]

    return re.sub(r"\\(.)", one, body, flags=re.DOTALL)


def parameters(text: str) -> dict[str, str]:
    """Every ``parameters`` entry of a config.pbtxt, key -> unescaped string value."""
    return {m["key"]: unescape(m["value"]) for m in _ENTRY.finditer(text)}


def config_json(text: str) -> dict[str, Any]:
    """The decoded JSON of the config's one parameter, ``splitserve_config``."""
    params = parameters(text)
    assert list(params) == [CONFIG_PARAMETER], params
    data = json.loads(params[CONFIG_PARAMETER])
    assert isinstance(data, dict)
    return data


def serving_config(text: str) -> ServingConfig:
    """The ServingConfig the stubs of a rendered config.pbtxt run with."""
    params = parameters(text)
    assert list(params) == [CONFIG_PARAMETER], params
    return ServingConfig.from_json(params[CONFIG_PARAMETER])


def rendered(repo: Path, model: str) -> ServingConfig:
    return serving_config((repo / model / "config.pbtxt").read_text())
