"""OpenAI-style error objects: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any


def error_type(status: int) -> str:
    if status == HTTPStatus.SERVICE_UNAVAILABLE:
        return "service_unavailable_error"
    return "invalid_request_error" if status < 500 else "server_error"


class APIError(Exception):
    """An error to answer with ``status`` and an OpenAI error object."""

    def __init__(
        self,
        message: str,
        status: int = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": error_type(self.status),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param=param)


def unsupported(param: str, what: str) -> APIError:
    return APIError(f"'{param}' {what} is not supported", HTTPStatus.BAD_REQUEST, param=param)


def model_not_found(model: str, served: list[str]) -> APIError:
    return APIError(
        f"The model '{model}' does not exist; this server serves {', '.join(served)}",
        HTTPStatus.NOT_FOUND,
        param="model",
        code="model_not_found",
    )


def triton_unavailable(url: str, detail: str) -> APIError:
    return APIError(
        f"the Triton server at {url} is unreachable: {detail}",
        HTTPStatus.SERVICE_UNAVAILABLE,
        code="triton_unavailable",
    )


def triton_silent(idle_s: float) -> APIError:
    """A request whose Triton stream went silent (a model instance died, Triton hung).

    504, not 503: the frontend is a gateway whose upstream stopped answering mid-request, which
    is what proxies answer for an upstream timeout; 503 stays the answer for a Triton that is
    down or full before the request started. OpenAI's SDKs retry both.
    """
    return APIError(
        f"Triton sent nothing for {idle_s:g} s; the request was cancelled",
        HTTPStatus.GATEWAY_TIMEOUT,
        code="triton_timeout",
    )


SERVER_ERROR_MARKERS = ("internal error", "prefill failed")
UNAVAILABLE_MARKERS = (
    "kv pool is full",
    "shutting down",
    "unknown model",
    "is not ready",
    "unavailable",
)


def from_triton_message(message: str) -> APIError:
    """Classify an error a generate model answered with.

    Triton's gRPC stream carries only the message, not the status code. The models answer bad
    input with INVALID_ARG (the common case, a 400); their internal and capacity failures say so
    in the message.
    """
    text = message.lower()
    if any(marker in text for marker in SERVER_ERROR_MARKERS):
        return APIError(message, HTTPStatus.INTERNAL_SERVER_ERROR)
    if any(marker in text for marker in UNAVAILABLE_MARKERS):
        return APIError(message, HTTPStatus.SERVICE_UNAVAILABLE)
    return APIError(message, HTTPStatus.BAD_REQUEST)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A message and a ``param`` from pydantic/FastAPI validation errors."""
    parts = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else err.get("msg", ""))
    first = [str(p) for p in errors[0].get("loc", ()) if p != "body"] if errors else []
    return "; ".join(parts) or "invalid request", (first[0] if first else None)
