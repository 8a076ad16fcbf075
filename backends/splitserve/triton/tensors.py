"""Conversions between Triton tensors/responses and plain Python values."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def model_parameters(model_config: dict[str, Any]) -> dict[str, str]:
    return {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}


def request_inputs(request: Any) -> dict[str, np.ndarray]:
    return {t.name(): t.as_numpy() for t in request.inputs()}


def bytes_tensor(name: str, values: list[bytes] | list[str]) -> Any:
    data = [v.encode() if isinstance(v, str) else v for v in values]
    return pb_utils.Tensor(name, np.array(data, dtype=np.object_))


def error_response(message: str, code: Any = None) -> Any:
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def instance_index(args: dict[str, str]) -> int:
    """Index of this instance within its model (Triton names them ``<group>_<index>``)."""
    tail = args["model_instance_name"].rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else 0
