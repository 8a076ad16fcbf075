"""A modelled GPU profile: step times computed from a GPU's memory bandwidth and FLOP rate.

Used until a profile can be measured on the GPU itself; the profile says ``modelled: true`` and
carries every assumption in ``hardware``. Per step (weights ``W`` bytes, matmul parameters
``P``, ``L`` layers):

- prefill ``a + b·T + c·S``: ``a = W / (bw·e_bw) + L·t_layer``, ``b = 2P / (F·e_mm)``,
  ``c = 2·L·heads·head_dim / (F·e_attn)`` (causal attention: half of ``4·heads·head_dim`` FLOPs
  per query-key pair);
- decode ``a + b·B + c·C``: ``a`` as above, ``b = 2(P + hidden·vocab) / (F·e_mm)``,
  ``c = kv_bytes_per_token / (bw·e_bw)`` (each step reads every cached token once).

A decode step is the sum of its memory and compute times, not the larger one: an upper bound
that is close where one term dominates, which it does at both ends of the batch range.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from splitserve.kv.layout import DTYPES
from splitserve.model.hf_config import ModelConfig
from splitserve_tools.planner.fit import DecodeFit, DecodeRange, HandoffFit, PrefillFit
from splitserve_tools.planner.profile import (
    ModelShape,
    Profile,
    Rates,
    ServingOverhead,
    UnitProfile,
)


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bandwidth: float
    """Bytes/s."""
    dense_flops: float
    """FLOP/s of dense matmuls at the profile's dtype."""
    memory_bytes: int
    link_bandwidth: float
    """Bytes/s one way between two GPUs (the KV handoff)."""


H200 = GpuSpec(
    name="NVIDIA H200 (datasheet)",
    memory_bandwidth=4.8e12,
    dense_flops=989e12,
    memory_bytes=141 * 10**9,
    link_bandwidth=450e9,
)


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet rates the engine reaches, and fixed costs: assumptions."""

    bandwidth: float = 0.7
    matmul: float = 0.6
    attention: float = 0.4
    layer_overhead_s: float = 60e-6
    """Kernel launches of one layer in eager mode (no CUDA graphs)."""
    handoff_fixed_s: float = 50e-6
    link: float = 0.7


def matmul_params(cfg: ModelConfig) -> int:
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    attn = h * cfg.num_heads * cfg.head_dim * 2 + h * kv * 2
    mlp = 3 * h * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp)


@dataclass(frozen=True)
class StepWork:
    """What one model's steps read and compute, whatever runs them."""

    params: int
    """Matmul parameters of the layers."""
    lm_head: int
    read_bytes: int
    """Weights a decode step reads: the layers' matrices and the LM head."""
    kv_bytes_per_token: int
    attention_flops: int
    """Causal attention FLOPs per (query, key) pair over all layers, halved for causality:
    ``2·L·heads·head_dim``."""


def step_work(cfg: ModelConfig, dtype: str) -> StepWork:
    elt = DTYPES[dtype].itemsize
    params = matmul_params(cfg)
    lm_head = cfg.hidden_size * cfg.vocab_size
    return StepWork(
        params=params,
        lm_head=lm_head,
        read_bytes=(params + lm_head) * elt,
        kv_bytes_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elt,
        attention_flops=2 * cfg.num_layers * cfg.num_heads * cfg.head_dim,
    )


def modelled_profile(
    cfg: ModelConfig,
    model: str,
    dtype: str = "bfloat16",
    spec: GpuSpec = H200,
    eff: Efficiency | None = None,
    block_size: int = 16,
    max_model_len: int | None = None,
    serving: ServingOverhead | None = None,
) -> Profile:
    eff = eff or Efficiency()
    elt = DTYPES[dtype].itemsize
    work = step_work(cfg, dtype)
    params, lm_head, kv_per_token = work.params, work.lm_head, work.kv_bytes_per_token
    weight_bytes = (params + lm_head * (1 if cfg.tie_word_embeddings else 2)) * elt
    bw = spec.memory_bandwidth * eff.bandwidth
    fixed = work.read_bytes / bw + cfg.num_layers * eff.layer_overhead_s
    prefill = PrefillFit(
        a=fixed,
        b=2 * params / (spec.dense_flops * eff.matmul),
        c=work.attention_flops / (spec.dense_flops * eff.attention),
    )
    decode = DecodeFit(
        (
            DecodeRange(
                lo=1,
                a=fixed,
                b=2 * (params + lm_head) / (spec.dense_flops * eff.matmul),
                c=kv_per_token / bw,
            ),
        )
    )
    return Profile(
        model=model,
        device="gpu",
        dtype=dtype,
        modelled=True,
        hardware={
            "modelled_from": asdict(spec),
            "efficiency": asdict(eff),
            "gpu": spec.name,
            "gpu_memory_bytes": spec.memory_bytes,
        },
        shape=ModelShape(
            kv_bytes_per_token=kv_per_token,
            block_size=block_size,
            max_model_len=max_model_len or cfg.max_position_embeddings,
            weight_bytes=weight_bytes,
        ),
        handoff=HandoffFit(eff.handoff_fixed_s, spec.link_bandwidth * eff.link),
        units={
            1: UnitProfile(
                threads=0,
                prefill=prefill,
                decode=decode,
                rates=Rates(spec.memory_bandwidth, spec.dense_flops),
            )
        },
        serving=serving or ServingOverhead(),
    )
