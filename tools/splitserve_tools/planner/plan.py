"""``plan.json``: the chosen placement, what it was chosen for, and its deploy Layout.

CPU instances get contiguous core sets in role order (prefill, then decode; colocated from core
0); GPU instances get one GPU each in the same order. The engine parameters every role shares
(model, dtype, max_model_len, kv_cache_bytes) go to ``Layout.engine``; the batching limits go
where each role reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.deploy.render import Layout, RoleSpec
from splitserve_tools.planner.placement import Placement, Role

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Plan:
    model: str
    dtype: str
    device: str
    max_model_len: int
    placement: Placement
    predicted_goodput_rps: float
    context: dict[str, Any] = field(default_factory=dict)
    """What the plan was searched for: workload, SLOs, profile summary, alternatives."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {self.device!r}")
        if self.device == "gpu" and any(r.units != 1 for r in self.placement.roles().values()):
            raise ValueError(
                "GPU instances span one GPU each (the engine has no tensor parallelism)"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "model": self.model,
            "dtype": self.dtype,
            "device": self.device,
            "max_model_len": self.max_model_len,
            "placement": self.placement.to_dict(),
            "predicted_goodput_rps": self.predicted_goodput_rps,
            "context": self.context,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"plan format {d.get('version')!r}, expected {FORMAT_VERSION}")
        return cls(
            model=d["model"],
            dtype=d["dtype"],
            device=d["device"],
            max_model_len=int(d["max_model_len"]),
            placement=Placement.from_dict(d["placement"]),
            predicted_goodput_rps=float(d["predicted_goodput_rps"]),
            context=dict(d.get("context", {})),
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Plan:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_layout(self, model: str | None = None) -> Layout:
        """The deploy Layout of this plan (``model`` overrides the checkpoint path)."""
        pl = self.placement
        lim = pl.limits
        engine = {
            "model": model or self.model,
            "dtype": self.dtype,
            "max_model_len": str(self.max_model_len),
            "kv_cache_bytes": str(lim.kv_cache_bytes),
        }
        params = {
            "prefill": {},
            "decode": {"max_num_seqs": str(lim.max_num_seqs)},
            "colocated": {
                "max_num_seqs": str(lim.max_num_seqs),
                "max_num_batched_tokens": str(lim.max_num_batched_tokens),
                "chunked_prefill": str(lim.chunked_prefill).lower(),
            },
        }
        specs: dict[str, RoleSpec] = {}
        start = 0
        for name, role in pl.roles().items():
            specs[name] = self._spec(role, start, params[name])
            start += role.devices
        return Layout(
            layout=pl.mode,
            device=self.device,
            engine=engine,
            prefill_max_batch_size=lim.prefill_max_batch_size,
            prefill_queue_delay_us=round(lim.prefill_queue_delay_s * 1e6),
            **specs,
        )

    def _spec(self, role: Role, start: int, params: dict[str, str]) -> RoleSpec:
        if self.device == "gpu":
            return RoleSpec(gpus=tuple(range(start, start + role.instances)), params=params)
        sets = []
        for i in range(role.instances):
            lo = start + i * role.units
            sets.append(f"{lo}-{lo + role.units - 1}" if role.units > 1 else str(lo))
        return RoleSpec(instances=role.instances, cpu_cores=";".join(sets), params=params)
