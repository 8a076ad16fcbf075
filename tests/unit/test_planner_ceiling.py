"""Goodput ceilings: the fluid bounds on known costs, the roofline's step times, the report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest
from test_planner_profile import synthetic_profile

from splitserve.model.tiny import tiny_config
from splitserve_tools.planner.ceiling import (
    Lengths,
    UnitCost,
    ceilings,
    decode_token_cost,
)
from splitserve_tools.planner.ceiling_report import ceiling_dict, ceiling_lines, extrapolation_lines
from splitserve_tools.planner.fit import DecodeFit, DecodeRange, DecodeSample, PrefillFit
from splitserve_tools.planner.gpu_model import H200, matmul_params, modelled_profile
from splitserve_tools.planner.plan_ceiling import _measured, from_bench, resolve
from splitserve_tools.planner.profile import Rates
from splitserve_tools.planner.roofline import engine_costs, roofline_costs, shared_rates


def linear_step(batch: int, context: float) -> float:
    return 0.01 + 0.001 * batch


UNIT = UnitCost(prefill=lambda n: 0.1, step=linear_step)


def test_lengths_average_the_context_over_every_decode_step() -> None:
    # Prefill makes token 0; the steps making tokens 1 and 2 of a 10-token prompt read 11 and 12.
    lengths = Lengths.of([(10, 3)])
    assert lengths.mean_output == 3 and lengths.decode_tokens == 2
    assert lengths.mean_decode_context == pytest.approx(11.5)
    two = Lengths.of([(10, 3), (100, 2)])
    assert two.decode_tokens == pytest.approx(1.5)
    assert two.mean_decode_context == pytest.approx((11 + 12 + 101) / 3)
    with pytest.raises(ValueError, match="no decode step"):
        Lengths.of([(10, 1)])


def test_the_cheapest_token_is_at_the_largest_batch_within_the_target() -> None:
    cost = decode_token_cost(linear_step, context=0.0, tpot_s=0.05)
    assert cost.batch == 40
    assert cost.seconds == pytest.approx(0.05 / 40)
    none = decode_token_cost(linear_step, context=0.0, tpot_s=0.005)
    assert none.batch == 0 and math.isinf(none.seconds)


def test_shared_and_split_ceilings_on_known_costs() -> None:
    lengths = Lengths(mean_output=11, decode_tokens=10, mean_decode_context=0.0, prompts=(100,))
    c = ceilings({1: UNIT}, lengths, tpot_s=0.05, devices=2)
    unit = c.units[1]
    assert unit.prefill_rps == pytest.approx(10)
    assert unit.decode_rps == pytest.approx(1 / (10 * 0.05 / 40))
    assert c.shared_rps == pytest.approx(2 / (0.1 + 10 * 0.05 / 40))
    assert (c.prefill_size, c.decode_size) == (1, 1)
    assert c.split_rps == {1: pytest.approx(10)}
    assert c.colocated_rps == {1: pytest.approx(c.shared_rps)}
    # Sharing every core between phases is never worse than any split of them.
    assert all(c.shared_rps >= r for r in c.split_rps.values())


def test_a_side_without_an_instance_size_that_fits_has_no_rate() -> None:
    lengths = Lengths(mean_output=11, decode_tokens=10, mean_decode_context=0.0, prompts=(100,))
    c = ceilings({2: UNIT}, lengths, tpot_s=0.05, devices=3)
    assert c.split_rps == {1: 0.0, 2: 0.0}
    # Fluid: the third device counts, at the cost per device of two-device instances.
    assert c.shared_rps == pytest.approx(3 / (2 * 0.1 + 2 * 10 * 0.05 / 40))
    with pytest.raises(ValueError, match="no instance size fits"):
        ceilings({4: UNIT}, lengths, tpot_s=0.05, devices=2)


def test_shared_ceiling_takes_each_phase_on_its_cheapest_instance_size() -> None:
    # Two-core instances prefill at 3x the rate of one core (cheaper per core), decode at 1x.
    lengths = Lengths(mean_output=11, decode_tokens=10, mean_decode_context=0.0, prompts=(100,))
    two = UnitCost(prefill=lambda n: 0.1 / 3, step=linear_step)
    c = ceilings({1: UNIT, 2: two}, lengths, tpot_s=0.05, devices=2)
    assert (c.prefill_size, c.decode_size) == (2, 1)
    assert c.shared_rps == pytest.approx(2 / (2 * 0.1 / 3 + 10 * 0.05 / 40))
    assert c.colocated_rps[2] == pytest.approx(1 / (0.1 / 3 + 10 * 0.05 / 40))
    assert c.colocated_rps[2] < c.shared_rps


def test_engine_costs_leave_out_the_prefill_pass_fixed_cost() -> None:
    profile = synthetic_profile(
        prefill=PrefillFit(0.5, 1e-3, 1e-6), decode=DecodeFit((DecodeRange(1, 0.02, 1e-3, 0.0),))
    )
    cost = engine_costs(profile)[1]
    assert cost.prefill(100) == pytest.approx(0.1 + 0.01)
    assert cost.step(4, 0.0) == pytest.approx(0.024)


def test_roofline_step_is_the_larger_of_reading_and_computing() -> None:
    cfg = tiny_config()
    rates = Rates(read_bytes_per_s=1e10, matmul_flops=1e11)
    base = synthetic_profile()
    unit = dataclasses.replace(base.unit(1), rates=rates)
    profile = dataclasses.replace(base, units={1: unit})
    assert roofline_costs(cfg, base, 1) == {}
    step = roofline_costs(cfg, profile, 1)[1].step
    params = matmul_params(cfg) + cfg.hidden_size * cfg.vocab_size
    weights = params * 4  # the synthetic profile is float32
    assert step(1, 0.0) == pytest.approx(max(weights / 1e10, 2 * params / 1e11))
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert step(1, 1e6) == pytest.approx((weights + 1e6 * kv) / 1e10)
    assert step(10_000, 0.0) == pytest.approx(2 * params * 10_000 / 1e11)


def test_instances_share_the_machines_memory_bandwidth() -> None:
    rates = {1: Rates(38e9, 4e11), 2: Rates(42e9, 8e11), 4: Rates(50e9, 1.6e12)}
    shared = shared_rates(rates, 2)
    assert shared == {1: Rates(21e9, 4e11), 2: Rates(42e9, 8e11)}
    assert shared_rates({2: Rates(42e9, 8e11)}, 1) == {}


def test_report_names_every_row_and_the_measured_fraction() -> None:
    lengths = Lengths(mean_output=11, decode_tokens=10, mean_decode_context=0.0, prompts=(100,))
    c = ceilings({1: UNIT}, lengths, tpot_s=0.05, devices=2)
    profile = synthetic_profile()
    lines = ceiling_lines(profile, lengths, 0.05, {"engine": c}, {"llm": c.shared_rps / 2})
    text = "\n".join(lines)
    assert "disaggregated 1 + 1" in text and "any placement" in text
    assert "colocated, 1-core instances" in text
    assert "measured llm" in text and "0.50 of the engine (any placement)" in text
    doc = ceiling_dict(lengths, 0.05, {"engine": c}, {"llm": 1.0})
    assert doc["ceilings"]["engine"]["split_rps"]["1"] == pytest.approx(10)


def test_a_ceiling_past_the_profiled_batches_says_its_fit_is_extrapolated() -> None:
    lengths = Lengths(mean_output=11, decode_tokens=10, mean_decode_context=0.0, prompts=(100,))
    c = ceilings({1: UNIT}, lengths, tpot_s=0.05, devices=2)  # best batch: 40
    profile = synthetic_profile()
    assert extrapolation_lines(profile, c) == []  # no samples: a modelled profile
    measured = dataclasses.replace(
        profile.units[1], decode_samples=tuple(DecodeSample(b, 0.0, 0.01) for b in (1, 4, 16))
    )
    (note,) = extrapolation_lines(dataclasses.replace(profile, units={1: measured}), c)
    assert "batch 40, past the largest profiled (16)" in note
    assert note.endswith("--decode-batches 1,4,16,32,64")
    wide = dataclasses.replace(measured, decode_samples=(DecodeSample(64, 0.0, 0.1),))
    assert extrapolation_lines(dataclasses.replace(profile, units={1: wide}), c) == []


def test_a_target_below_one_step_allows_no_rate() -> None:
    lengths = Lengths(mean_output=11, decode_tokens=10, mean_decode_context=0.0, prompts=(100,))
    c = ceilings({1: UNIT}, lengths, tpot_s=0.005, devices=2)
    assert c.shared_rps == 0 and c.split_rps == {1: 0} and c.units[1].decode_rps == 0
    lines = ceiling_lines(synthetic_profile(), lengths, 0.005, {"engine": c}, {"llm": 1.0})
    assert "the engine allows 0" in lines[-1]
    assert (
        ceiling_dict(lengths, 0.005, {"engine": c}, {})["ceilings"]["engine"]["units"]["1"][
            "token_s"
        ]
        is None
    )


def test_measured_flag_parses_label_and_rate() -> None:
    assert _measured("openai:http://h:1/v1@m=11.3") == ("openai:http://h:1/v1@m", 11.3)
    for bad in ("llm", "=3", "llm=fast"):
        with pytest.raises(Exception, match="LABEL=REQ_PER_S"):
            _measured(bad)


def test_modelled_gpus_each_keep_their_own_bandwidth() -> None:
    cfg = tiny_config()
    profile = modelled_profile(cfg, "tiny", "bfloat16")
    step = roofline_costs(cfg, profile, 8)[1].step
    weights = (matmul_params(cfg) + cfg.hidden_size * cfg.vocab_size) * 2
    assert step(1, 0.0) == pytest.approx(weights / H200.memory_bandwidth)


def test_a_bench_report_gives_the_goodputs_and_the_settings_left_out(tmp_path: Path) -> None:
    report = tmp_path / "goodput.json"
    config = {"workload": "summarization", "tpot_slo": 0.05, "max_model_len": 1024}
    summary = [{"target": "llm", "goodput_rps": 2.5}, {"target": "llm_colocated", "goodput_rps": 2}]
    report.write_text(json.dumps({"config": config, "summary": summary}))
    args = argparse.Namespace(
        bench=[report], measured=[("target", 5.0)], workload=None, input_len=None,
        output_len=None, tpot_slo=0.1, max_model_len=None,
    )  # fmt: skip
    assert resolve(args) == {"llm": 2.5, "llm_colocated": 2.0, "target": 5.0}
    assert (args.workload, args.tpot_slo, args.max_model_len) == ("summarization", 0.1, 1024)
    with pytest.raises(SystemExit, match="not a bench goodput report"):
        from_bench(tmp_path)
