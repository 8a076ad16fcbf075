"""``prefill`` streaming its KV by layer (a decoupled model): per request, the handle before the
pass, a ``layers_ready`` count as each run of layers is written (``serving.layer_chunks``), the
first token last (FINAL).

The counts go out from a sender thread of the batch, so the pass never waits on Triton's IPC;
it sends the newest count only (a pass can outrun the sends), and it sends a count only once
the layer is in memory: on a GPU, once an event recorded after the layer's writes has passed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from splitserve.serving import bls_contract

log = logging.getLogger(__name__)


def layers_tensor(count: int) -> Any:
    return pb_utils.Tensor(bls_contract.LAYERS_READY, np.array([[count]], dtype=np.int32))


def handle_response(handle: bytes) -> Any:
    """The first response of a streamed request: its KV handle, no layer written yet."""
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor(bls_contract.KV_HANDLE, np.frombuffer(handle, np.uint8)[None, :]),
            layers_tensor(0),
        ]
    )


def token_response(token: int, num_layers: int) -> Any:
    """The last response of a streamed request: every layer written, the first token."""
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor(bls_contract.FIRST_TOKEN, np.array([[token]], dtype=np.int64)),
            layers_tensor(num_layers),
        ]
    )


class LayerAnnouncer:
    """Sends each request of one batch the newest written-layer count, off the pass's thread."""

    def __init__(self, senders: Sequence[Any], device: torch.device) -> None:
        self._senders = list(senders)
        self._cuda = device.type == "cuda"
        self._cond = threading.Condition()
        self._newest: tuple[int, Any] | None = None
        self._sent = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="splitserve-layers", daemon=True)
        if self._senders:  # a batch answered whole has nobody to announce to
            self._thread.start()

    def written(self, count: int) -> None:
        """The first ``count`` layers of the batch are written (enqueued, on a GPU)."""
        event = torch.cuda.Event() if self._cuda else None
        if event is not None:
            event.record()
        with self._cond:
            self._newest = (count, event)
            self._cond.notify()

    def close(self) -> None:
        """Send what is pending, then stop; the batch's final responses follow."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._newest is None and not self._closed:
                    self._cond.wait()
                newest, self._newest = self._newest, None
                closed = self._closed
            if newest is not None:
                count, event = newest
                if event is not None:
                    event.synchronize()
                if count > self._sent:
                    self._sent = count
                    for sender in self._senders:
                        send(sender, pb_utils.InferenceResponse([layers_tensor(count)]))
            if closed:
                return


def send(sender: Any, response: Any, flags: int = 0) -> None:
    """Send, logging a failure: a request the caller cancelled may refuse responses, and the
    batch's other requests must still get theirs."""
    try:
        sender.send(response, flags=flags)
    except Exception:  # pb_utils raises TritonModelException, not importable outside a stub
        log.warning("could not send a prefill response", exc_info=True)
