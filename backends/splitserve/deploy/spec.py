"""The deployment spec: every setting of one Splitserve server in one typed, validated object.

Layout, placement (instances, cores, GPUs), the engine and serving settings of every role,
lending, ports. Defaults live in ``EngineConfig`` and ``ServingConfig`` only; a spec names what
differs. Constructing one checks everything, including the ``ServingConfig`` each model's stubs
will run with, so a bad value fails before any process starts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.engine_config import EngineConfig
from splitserve.serving.affinity import format_cores, parse_ranges
from splitserve.serving.serving_config import ServingConfig, parse_core_sets
from splitserve.typed_values import (
    check_value,
    field_types,
    value_from_text,
    values_from_mapping,
)

LAYOUTS: dict[str, tuple[str, ...]] = {
    "disagg": ("llm", "prefill"),
    "colocated": ("llm_colocated",),
    "both": ("llm", "prefill", "llm_colocated"),
}
ROLE_OF = {"llm": "decode", "prefill": "prefill", "llm_colocated": "colocated"}
SERVER_ROLES = ("both", "prefill", "decode")
"""What one server runs: ``both`` phases (one server), or only ``prefill`` / ``decode`` (the
split across servers, KV over the network)."""
SPLIT_TRANSPORT = "nixl"
REMOTE_KEYS = ("prefill_urls", "prefill_dns")
GPU_TRANSPORT = "cuda_ipc"
PLACED = frozenset({"role", "engine", "cpu_cores", "core_lock", "lent_cores", "lend_cores"})
"""ServingConfig fields the spec derives from placement and lending, never set directly."""
LOCK_NAME = "core.lock"


def setting_types() -> dict[str, Any]:
    """Every key a deployment may set (engine and serving fields) -> its declared type."""
    serving = {k: v for k, v in field_types(ServingConfig).items() if k not in PLACED}
    return {**field_types(EngineConfig), **serving}


def setting_from_text(key: str, raw: str) -> Any:
    """``--param KEY=VALUE``: the typed value, or ValueError naming the key and what it takes."""
    types_of = setting_types()
    if key not in types_of:
        raise ValueError(f"unknown setting {key!r}; accepted: {', '.join(sorted(types_of))}")
    section = EngineConfig if key in field_types(EngineConfig) else ServingConfig
    return value_from_text(section, key, raw)


def _check_settings(settings: Mapping[str, Any], where: str) -> None:
    types_of = setting_types()
    for key, value in settings.items():
        if key not in types_of:
            accepted = ", ".join(sorted(types_of))
            raise ValueError(f"{where}: unknown setting {key!r}; accepted: {accepted}")
        try:
            check_value(types_of[key], value)
        except ValueError:
            raise ValueError(f"{where}: setting {key!r} cannot be {value!r}") from None


def parse_gpus(spec: str) -> tuple[int, ...]:
    """``"0"``, ``"0,1"`` or ``"0-3"`` -> sorted distinct GPU ids."""
    return tuple(sorted(parse_ranges(spec, "GPU ids")))


@dataclass(frozen=True)
class RoleSpec:
    instances: int = 1
    """Instances of the role's model (on each listed GPU, for GPU layouts)."""
    cpu_cores: str = ""
    """Per-instance core sets, ``;``-separated (see ServingConfig.cpu_cores)."""
    gpus: tuple[int, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    """Engine and serving settings of this role only (over the spec's ``settings``)."""

    def __post_init__(self) -> None:
        if self.instances <= 0:
            raise ValueError("instances must be positive")
        if len(set(self.gpus)) != len(self.gpus) or any(g < 0 for g in self.gpus):
            raise ValueError(f"GPU ids must be distinct and non-negative, got {list(self.gpus)}")
        parse_core_sets(self.cpu_cores)


@dataclass(frozen=True)
class DeploymentSpec:
    layout: str = "both"
    device: str = "cpu"
    """``cpu`` (KIND_CPU, shm handoff) or ``gpu`` (KIND_GPU, CUDA IPC handoff)."""
    settings: Mapping[str, Any] = field(default_factory=lambda: {"model": "tiny"})
    """Engine and serving settings every role gets (``model``, ``dtype``, ``max_queue``, ...)."""
    prefill: RoleSpec = RoleSpec()
    decode: RoleSpec = RoleSpec()
    colocated: RoleSpec = RoleSpec()
    prefill_max_batch_size: int = 8
    prefill_queue_delay_us: int = 1000
    lend_prefill_cores: bool | None = None
    """Decode also steps on the prefill cores while prefill is idle (``serving.core_lend``):
    True requires it (CPU, one prefill and one decode instance on disjoint cores), False turns
    it off, None lends wherever the layout allows."""
    lend_decode_cores: bool | None = None
    """Prefill's passes also run on the decode cores while decode's steps leave room under its
    ``tpot_target_s`` (``serving.decode_lend``); True, False and None as for
    ``lend_prefill_cores``."""
    server_cores: str | None = None
    """Cores for tritonserver's own threads; ``all`` leaves them anywhere; None puts them on the
    prefill cores of a CPU layout with prefill."""
    host: str = "0.0.0.0"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    thread_pool_size: int = 128
    """The Python backend's thread pool (BLS calls and decoupled senders)."""
    server_role: str = "both"
    """``both``: the layout's models on this server. ``prefill``: only ``prefill``, serving
    decode servers elsewhere. ``decode``: the layout's other models, ``llm`` calling the prefill
    servers named by the decode role's ``prefill_urls`` or ``prefill_dns``."""
    key_file: str | None = None
    """The handle key (hex, mode 0600) shared by the prefill and decode servers of one
    deployment; required when the roles are split. None: a fresh key per server start."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {self.layout!r}")
        if self.server_role not in SERVER_ROLES:
            raise ValueError(f"role must be one of {list(SERVER_ROLES)}, got {self.server_role!r}")
        self._check_split()
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {self.device!r}")
        if self.prefill_max_batch_size <= 0:
            raise ValueError(
                f"prefill_max_batch_size must be positive, got {self.prefill_max_batch_size}"
            )
        if self.prefill_queue_delay_us < 0:
            raise ValueError(
                f"prefill_queue_delay_us must be >= 0, got {self.prefill_queue_delay_us}"
            )
        if self.server_cores not in (None, "all"):
            parse_ranges(self.server_cores, "server cores")
        _check_settings(self.settings, "settings")
        for model in self.models:
            role = ROLE_OF[model]
            spec = self.role(role)
            _check_settings(spec.settings, f"{role}.settings")
            if self.device == "gpu" and not spec.gpus:
                raise ValueError(f"device 'gpu' needs GPU ids for the {role} role")
            if self.device == "cpu" and spec.gpus:
                raise ValueError(
                    f"the {role} role lists GPUs {list(spec.gpus)} but device is 'cpu'"
                )
        if (self.lend_prefill_cores or self.lend_decode_cores) and (
            refusal := lending_refusal(self)
        ) is not None:
            raise ValueError(refusal)
        for model in self.models:
            self.serving_config(model, Path("/"))

    def _check_split(self) -> None:
        split = self.server_role != "both"
        if split and "prefill" not in LAYOUTS[self.layout]:
            raise ValueError(f"--role {self.server_role} needs a layout with prefill (disagg)")
        if split and not self.key_file:
            raise ValueError(
                f"--role {self.server_role} needs --key-file: the handle key shared by the "
                "prefill and decode servers"
            )
        for key in REMOTE_KEYS:
            if key in self.settings:
                raise ValueError(f"{key} is a decode-role setting (decode.settings)")
        remote = [k for k in REMOTE_KEYS if self.decode.settings.get(k)]
        if self.server_role == "decode" and not remote:
            raise ValueError("--role decode needs --prefill-url HOST:PORT or --prefill-dns NAME")
        if self.server_role != "decode" and remote:
            flags = ", ".join(remote)
            raise ValueError(f"{flags} apply to --role decode (this server runs its own prefill)")

    @property
    def models(self) -> tuple[str, ...]:
        if self.server_role == "prefill":
            return ("prefill",)
        if self.server_role == "decode":
            return tuple(m for m in LAYOUTS[self.layout] if m != "prefill")
        return LAYOUTS[self.layout]

    @property
    def model(self) -> str:
        return str(self.settings.get("model", EngineConfig.model))

    def role(self, name: str) -> RoleSpec:
        spec = getattr(self, name)
        assert isinstance(spec, RoleSpec)
        return spec

    @property
    def lends(self) -> bool:
        """Prefill lends its cores to decode."""
        return self._lends(self.lend_prefill_cores)

    @property
    def lends_decode(self) -> bool:
        """Decode lends its cores to prefill."""
        return self._lends(self.lend_decode_cores)

    def _lends(self, asked: bool | None) -> bool:
        """None: wherever the layout allows."""
        return lending_refusal(self) is None if asked is None else asked

    def serving_config(self, model: str, repo_dir: Path) -> ServingConfig:
        """What the stubs of ``model`` run with when the repository is rendered in ``repo_dir``
        (the lending lock lives there)."""
        role = ROLE_OF[model]
        spec = self.role(role)
        merged = {**self.settings, **spec.settings}
        if role in ("prefill", "decode") and self.server_role != "both":
            merged.setdefault("transport", SPLIT_TRANSPORT)
        if role == "prefill" and self.server_role == "prefill":
            if merged.get("transport") == "nixl":
                # Decode servers elsewhere pull each layer while the pass runs.
                merged.setdefault("kv_stream_layers", True)
        elif merged.get("kv_stream_layers"):
            raise ValueError(
                "kv_stream_layers applies to prefill servers (--role prefill): BLS within one "
                "server takes the handle after the pass"
            )
        if role == "decode" and self.server_role == "decode":
            # A decode server's cores are sized for decode: a prompt pass there would stall
            # every running stream, so a lost handoff ends its request (UNAVAILABLE).
            merged.setdefault("kv_load_failure_policy", "fail")
        if self.device == "gpu":
            merged["device"] = "cuda"
            if role in ("prefill", "decode"):
                merged.setdefault("transport", GPU_TRANSPORT)
        engine_keys = field_types(EngineConfig)
        engine = EngineConfig(**{k: v for k, v in merged.items() if k in engine_keys})
        serving = {k: v for k, v in merged.items() if k not in engine_keys}
        placed: dict[str, Any] = {}
        if self.device == "cpu" and spec.cpu_cores:
            placed["cpu_cores"] = spec.cpu_cores
        if (self.lends or self.lends_decode) and role in ("prefill", "decode"):
            placed["core_lock"] = str(repo_dir / LOCK_NAME)
            if role == "decode" and self.lends:
                placed["lent_cores"] = self.prefill.cpu_cores
            if role == "decode" and self.lends_decode:
                placed["lend_cores"] = True
            if role == "prefill" and self.lends_decode:
                placed["lent_cores"] = self.decode.cpu_cores
        return ServingConfig(role=role, engine=engine, **serving, **placed)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "deployment") -> DeploymentSpec:
        roles = {"prefill": RoleSpec, "decode": RoleSpec, "colocated": RoleSpec}
        return cls(**values_from_mapping(cls, data, where=where, nested=roles))


def lending_refusal(spec: DeploymentSpec) -> str | None:
    """Why the prefill and decode instances of ``spec`` cannot lend each other their cores,
    or None."""
    if spec.device != "cpu" or spec.server_role != "both" or "prefill" not in spec.models:
        return "lending cores needs a CPU layout with prefill and decode on one server"
    if spec.prefill.instances != 1 or spec.decode.instances != 1:
        return "lending cores needs one prefill and one decode instance"
    prefill = parse_core_sets(spec.prefill.cpu_cores)
    own = parse_core_sets(spec.decode.cpu_cores)
    if len(prefill) != 1 or len(own) != 1 or prefill[0] & own[0]:
        return (
            "lending cores needs one core set per role, with no core in both "
            f"(prefill {spec.prefill.cpu_cores!r}, decode {spec.decode.cpu_cores!r})"
        )
    return None


def server_cores(spec: DeploymentSpec) -> set[int] | None:
    """Where tritonserver's own threads go: ``spec.server_cores``, or by default on CPUs the
    prefill instances' cores, away from decode's engine threads, whose steps pace every stream
    (TPOT); None (anywhere) for ``all``, GPU layouts and layouts without prefill."""
    if spec.server_cores == "all":
        return None
    if spec.server_cores is not None:
        return parse_ranges(spec.server_cores, "server cores")
    if spec.device != "cpu" or "prefill" not in spec.models:
        return None
    cores = set().union(*parse_core_sets(spec.prefill.cpu_cores))
    return cores or None


def default_cpu_spec(
    layout: str, settings: Mapping[str, Any], cores: int | None = None, **fields: Any
) -> DeploymentSpec:
    """Prefill on the first half of the cores, decode on the rest, colocated on all of them:
    cores ``0..cores-1``, or by default the cores this process may run on (a container pinned
    to cores 8-11 gets 8-9 and 10-11, not 0-3)."""
    usable = list(range(cores)) if cores else sorted(os.sched_getaffinity(0))
    half = max(1, len(usable) // 2)
    prefill, decode = (usable[:half], usable[half:]) if len(usable) > 1 else (usable, usable)
    return DeploymentSpec(
        layout=layout,
        settings=dict(settings),
        prefill=RoleSpec(cpu_cores=format_cores(prefill)),
        decode=RoleSpec(cpu_cores=format_cores(decode)),
        colocated=RoleSpec(cpu_cores=format_cores(usable)),
        **fields,
    )


def default_gpu_spec(
    layout: str,
    settings: Mapping[str, Any],
    prefill_gpus: tuple[int, ...] = (0,),
    decode_gpus: tuple[int, ...] = (0,),
    colocated_gpus: tuple[int, ...] | None = None,
    **fields: Any,
) -> DeploymentSpec:
    """One instance per listed GPU and role; ``llm_colocated`` defaults to every GPU used.

    Prefill and decode may share a GPU (two processes, KV still handed over by IPC)."""
    colocated = colocated_gpus or tuple(sorted({*prefill_gpus, *decode_gpus}))
    return DeploymentSpec(
        layout=layout,
        device="gpu",
        settings=dict(settings),
        prefill=RoleSpec(gpus=prefill_gpus),
        decode=RoleSpec(gpus=decode_gpus),
        colocated=RoleSpec(gpus=colocated),
        **fields,
    )
