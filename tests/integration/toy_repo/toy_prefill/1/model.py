"""Toy prefill: dynamic batching over ragged `input_ids`; returns each sum and the batch size."""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.delay_s = float(parameters.get("delay_ms", {}).get("string_value", "0")) / 1000

    def execute(self, requests: list) -> list:
        time.sleep(self.delay_s)
        batch_size = np.array([[len(requests)]], dtype=np.int32)
        responses = []
        for request in requests:
            input_ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            total = np.array([[int(input_ids.sum())]], dtype=np.int64)
            outputs = [pb_utils.Tensor("sum", total), pb_utils.Tensor("batch_size", batch_size)]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
