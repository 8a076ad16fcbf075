"""Triton entry of ``llm_colocated`` (baseline, one engine loop); logic in splitserve.triton."""

from splitserve.triton.colocated_model import ColocatedModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
