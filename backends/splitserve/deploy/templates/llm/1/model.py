"""Triton entry of ``llm`` (disaggregated decode stage); the logic lives in splitserve.triton."""

from splitserve.triton.decode_model import DecodeModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
