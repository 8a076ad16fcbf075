"""``plan.json``: the chosen placement, what it was chosen for, and its deployment spec.

CPU instances get consecutive core sets in role order (prefill, then decode; colocated from the
first core) out of ``cores`` (default ``0..N-1``; ``serve`` plans onto the cores it may run on);
GPU instances get one GPU each in the same order. The engine parameters every role shares
(model, dtype, max_model_len, kv_cache_bytes) go to the spec's settings; the batching limits go
to the settings of the role that reads them. ``splitserve serve --plan`` reads the
``deployment`` entry only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.deploy.spec import DeploymentSpec, RoleSpec
from splitserve.serving.affinity import format_cores
from splitserve_tools.planner.json_file import write_json
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
    cores: tuple[int, ...] | None = None
    """CPU: the cores the placement's units take, in order; None: ``0..N-1``."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {self.device!r}")
        if self.device == "gpu" and any(r.units != 1 for r in self.placement.roles().values()):
            raise ValueError(
                "GPU instances span one GPU each (the engine has no tensor parallelism)"
            )
        needed = sum(r.devices for r in self.placement.roles().values())
        if self.cores is not None and len(self.cores) < needed:
            raise ValueError(f"the placement takes {needed} cores, given {list(self.cores)}")

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
            **({"cores": list(self.cores)} if self.cores is not None else {}),
            "deployment": self.to_spec().to_dict(),
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
            cores=tuple(int(c) for c in d["cores"]) if "cores" in d else None,
        )

    def save(self, path: Path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: Path) -> Plan:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_spec(self, model: str | None = None) -> DeploymentSpec:
        """The deployment spec of this plan (``model`` overrides the checkpoint path)."""
        pl = self.placement
        lim = pl.limits
        settings: dict[str, Any] = {
            "model": model or self.model,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "kv_cache_bytes": lim.kv_cache_bytes,
        }
        if not lim.prefix_cache:
            settings["prefix_cache"] = "false"
        params: dict[str, dict[str, Any]] = {
            "prefill": {},
            "decode": {"max_num_seqs": lim.max_num_seqs, "tpot_target_s": lim.tpot_target_s},
            "colocated": {
                "max_num_seqs": lim.max_num_seqs,
                "max_num_batched_tokens": lim.max_num_batched_tokens,
                "chunked_prefill": lim.chunked_prefill,
            },
        }
        specs: dict[str, RoleSpec] = {}
        start = 0
        for name, role in pl.roles().items():
            specs[name] = self._spec(role, start, params[name])
            start += role.devices
        return DeploymentSpec(
            layout=pl.mode,
            device=self.device,
            settings=settings,
            prefill_max_batch_size=lim.prefill_max_batch_size,
            prefill_queue_delay_us=round(lim.prefill_queue_delay_s * 1e6),
            lend_prefill_cores=None if lim.lend_cores else False,
            lend_decode_cores=None if lim.lend_cores else False,
            **specs,
        )

    def _spec(self, role: Role, start: int, settings: dict[str, Any]) -> RoleSpec:
        if self.device == "gpu":
            return RoleSpec(gpus=tuple(range(start, start + role.instances)), settings=settings)
        cores = self.cores or tuple(range(start + role.devices))
        sets = []
        for i in range(role.instances):
            lo = start + i * role.units
            sets.append(format_cores(cores[lo : lo + role.units]))
        return RoleSpec(instances=role.instances, cpu_cores=";".join(sets), settings=settings)
