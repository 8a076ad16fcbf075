"""When a prompt pass hands on the layers it has written (announces them to the decode that pulls
them, WRITEs them into the blocks of a push): in runs of layers at least ``min_gap_s`` of pass
apart, the last layer at once.

Each hand-on costs the pass's node a fixed amount beside the bytes (a response through Triton,
one more READ or WRITE posted and served on the same cores): on the 2-core namespaces a 128-token
pass (about 10 ms a layer) ran 25-40 ms longer announcing each of its 12 layers than announcing
none. A gap bounds that cost to a fraction of the pass; a long prompt's layers, each longer than
the gap, still go one by one, so a link slower than the pass starts as early as it did
(BENCHMARKS.md, "Layer-wise KV streaming"). What still moves after the pass is the last run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class LayerChunks:
    """A pass's ``written(layer)`` hook that calls ``publish(layers)`` with the layers written
    since its last call, once ``min_gap_s`` has passed since then (since the hook was made, for
    the first) and always for the last layer."""

    def __init__(
        self,
        num_layers: int,
        min_gap_s: float,
        publish: Callable[[range], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._last_layer = num_layers - 1
        self._gap = min_gap_s
        self._publish = publish
        self._clock = clock
        self._since = clock()
        self._done = 0

    def written(self, layer: int) -> None:
        now = self._clock()
        if layer == self._last_layer or now - self._since >= self._gap:
            start, self._done, self._since = self._done, layer + 1, now
            self._publish(range(start, layer + 1))


def run_ends(num_layers: int, pass_s: float, min_gap_s: float) -> tuple[int, ...]:
    """The layer counts ``LayerChunks`` hands on at in a pass of ``pass_s`` seconds whose
    layers take equal time: every ``ceil(min_gap_s / layer time)`` layers, and the last."""
    if num_layers < 1:
        raise ValueError("a pass has at least one layer")
    if min_gap_s <= 0:
        stride = 1  # the hook's gap test always passes
    elif pass_s <= 0:
        stride = num_layers
    else:
        stride = max(1, math.ceil(min_gap_s * num_layers / pass_s - 1e-9))
    return (*range(stride, num_layers, stride), num_layers)
