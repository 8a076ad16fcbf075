"""When a pass hands on the layers it wrote: runs at least a gap of pass apart, the last layer at
once, every layer exactly once and in order."""

from __future__ import annotations

import pytest

from splitserve.serving.layer_chunks import LayerChunks, run_ends


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hand_on(layer_s: list[float], gap_s: float) -> list[range]:
    """The runs a pass whose layers take ``layer_s`` seconds hands on."""
    clock, published = Clock(), []
    hook = LayerChunks(len(layer_s), gap_s, published.append, clock).written
    for layer, seconds in enumerate(layer_s):
        clock.now += seconds
        hook(layer)
    return published


LAYER_S = 1 / 64
"""A layer's time in these tests: sums of it are exact in binary."""


def test_short_layers_go_in_runs_and_the_last_layer_at_once() -> None:
    assert hand_on([LAYER_S] * 12, 4 * LAYER_S) == [range(0, 4), range(4, 8), range(8, 12)]
    assert hand_on([LAYER_S] * 12, 4.5 * LAYER_S) == [range(0, 5), range(5, 10), range(10, 12)]


def test_layers_longer_than_the_gap_go_one_by_one() -> None:
    assert hand_on([0.1] * 4, 0.05) == [range(i, i + 1) for i in range(4)]
    assert hand_on([0.01] * 4, 0.0) == [range(i, i + 1) for i in range(4)]


def test_a_gap_longer_than_the_pass_hands_on_everything_at_the_end() -> None:
    assert hand_on([0.01] * 12, 1.0) == [range(0, 12)]


def test_uneven_layers_are_handed_on_by_time_not_by_count() -> None:
    assert hand_on([0.03, 0.03, 0.001, 0.1, 0.001], 0.05) == [
        range(0, 2),
        range(2, 4),
        range(4, 5),
    ]


@pytest.mark.parametrize(
    ("layers", "pass_s", "gap_s", "ends"),
    [
        (12, 12 * LAYER_S, 4 * LAYER_S, (4, 8, 12)),
        (12, 12 * LAYER_S, 4.5 * LAYER_S, (5, 10, 12)),
        (12, 1.2, 0.05, tuple(range(1, 13))),
        (12, 0.12, 0.0, tuple(range(1, 13))),
        (12, 0.12, 1.0, (12,)),
        (1, 0.1, 0.05, (1,)),
    ],
)
def test_run_ends_matches_the_hook_for_even_layers(
    layers: int, pass_s: float, gap_s: float, ends: tuple[int, ...]
) -> None:
    assert run_ends(layers, pass_s, gap_s) == ends
    assert tuple(r.stop for r in hand_on([pass_s / layers] * layers, gap_s)) == ends
