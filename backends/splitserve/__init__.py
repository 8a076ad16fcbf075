"""Splitserve: disaggregated prefill/decode LLM serving on Triton."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from splitserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.llm import LLM, CompletionOutput

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "CompletionOutput"):
        from splitserve import llm

        return getattr(llm, name)
    raise AttributeError(name)
