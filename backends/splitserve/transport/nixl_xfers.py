"""Posting NIXL transfers of one agent and following them to their end: what the reader's READs
and the owner's push WRITEs share."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from splitserve.transport.nixl_metadata import PeerPool

log = logging.getLogger(__name__)


class Transfers:
    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def prepare(
        self, op: str, local: np.ndarray, mem: str, remote: np.ndarray, peer: PeerPool
    ) -> Any:
        """A ``READ`` or ``WRITE`` between ``local`` descriptors (of ``mem``) and ``remote`` ones
        of ``peer``, not yet posted; raises what NIXL raises."""
        return self.agent.initialize_xfer(
            op,
            self.agent.get_xfer_descs(local, mem),
            self.agent.get_xfer_descs(remote, peer.mem),
            peer.agent_name,
        )

    def state(self, xfer: Any, post: bool = False) -> str:
        """``PROC``, ``DONE`` or ``ERR`` (posting it first with ``post``); NIXL raises for a
        failed transfer (a peer that disconnected), which is ``ERR`` here."""
        try:
            return str(self.agent.transfer(xfer) if post else self.agent.check_xfer_state(xfer))
        except Exception as exc:  # nixl's binding errors share no base class beyond Exception
            log.warning("KV transfer failed: %r", exc)
            return "ERR"

    def release(self, xfer: Any) -> None:
        try:
            self.agent.release_xfer_handle(xfer)
        except Exception:  # a failed transfer's handle; the agent frees it at close
            log.warning("could not release a KV transfer handle", exc_info=True)

    def poll(self, xfers: list[Any]) -> tuple[list[Any], str | None]:
        """One look at posted ``xfers``: those still running, and the state of the first that
        ended otherwise than ``DONE`` (None if none did); the ended ones are released."""
        running, failed = [], None
        for xfer in xfers:
            state = self.state(xfer)
            if state == "PROC":
                running.append(xfer)
                continue
            self.release(xfer)
            if state != "DONE" and failed is None:
                failed = state
        return running, failed

    def wait(self, xfers: list[Any], deadline: float) -> tuple[list[Any], str | None]:
        """``poll`` with doubling pauses until every transfer ended or ``deadline``
        (``time.monotonic()``) passed: those still running then, and the first failure."""
        pause, failed = 20e-6, None
        while True:
            xfers, bad = self.poll(xfers)
            failed = failed or bad
            if not xfers or time.monotonic() > deadline:
                return xfers, failed
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
