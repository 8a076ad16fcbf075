"""Triton entry of ``prefill`` (internal prompt stage); the logic lives in splitserve.triton."""

from splitserve.triton.prefill_model import PrefillModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
