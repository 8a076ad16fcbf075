"""Per-role serving configuration: what one Triton model's stubs run with, rendered into its
``config.pbtxt`` as one JSON parameter by ``splitserve.deploy``."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from splitserve.engine.scheduler import HANDOFF_FAILURE_POLICIES
from splitserve.engine_config import EngineConfig
from splitserve.serving.affinity import allowed_cores, parse_cores
from splitserve.typed_values import build

ROLES = ("prefill", "decode", "colocated")
TRANSPORTS = ("cuda_ipc", "nixl", "shm")
PREFILL_ROUTING = ("prefix", "least_loaded")
PULL_MARGIN_S = 5.0
"""How much longer than a NIXL reader's transfer timeout its owner keeps blocks being read."""
CONFIG_PARAMETER = "splitserve_config"
"""The ``config.pbtxt`` parameter that carries a model's ServingConfig as JSON."""


@dataclass(frozen=True)
class ServingConfig:
    role: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    transport: str = "shm"
    prefill_model: str = "prefill"
    """Name of the model ``llm`` calls for prompts (disaggregated decode role only)."""
    lease_ttl_s: float = 30.0
    """How long prefill keeps a handed-over request's blocks if nobody pulls them."""
    cpu_cores: str = ""
    """Core sets per instance, ``;``-separated (``"0;1"``: instance 0 on core 0, instance 1 on
    core 1); each set is a list/range like ``0,2-3``. Empty leaves placement to the OS."""
    core_lock: str = ""
    """Path of the locks by which one prefill and one decode instance lend each other their
    cores (``serving.core_lend``: prefill's between its passes; ``serving.decode_lend``:
    decode's to passes while its streams have time to spare); both roles name the same path.
    Empty: no lending."""
    lent_cores: str = ""
    """With ``core_lock``, the other role's cores (a set like ``0`` or ``0-1``) on which this
    instance adds threads when they are lent: decode's steps while prefill is idle, prefill's
    passes while decode offers them. Empty: it borrows none."""
    lend_cores: bool = False
    """Decode with ``core_lock``: offers its cores to prefill's passes while the mean time
    between its steps stays under 0.8 x ``tpot_target_s`` (and while it is idle)."""
    tpot_target_s: float = 0.1
    """Decode: the time per output token its streams should get; it lends its cores to prefill
    only while its steps leave room under it (``lend_cores``)."""
    default_max_tokens: int = 16
    prefill_retry_s: float = 60.0
    """How long ``llm`` keeps retrying a prompt while the prefill pool is full."""
    cancel_poll_s: float = 0.1
    """How often the engine loop asks Triton whether clients cancelled (an IPC per request)."""
    metrics_interval_s: float = 0.1
    max_queue: int = 1024
    """Requests an ``llm``/``llm_colocated`` instance holds beyond its running batch (waiting
    for prefill, KV blocks or a batch slot); more are refused with UNAVAILABLE. 0: no bound."""
    request_timeout_s: float | None = None
    """Seconds a request may take if it gives no ``timeout``/``deadline_ms``; None: no limit."""
    prefill_urls: str = ""
    """Decode role: comma-separated ``HOST:PORT`` gRPC addresses of prefill servers, called
    instead of the local ``prefill`` model. Empty: BLS to the local model."""
    prefill_dns: str = ""
    """Decode role: ``NAME[:PORT]`` resolved every few seconds to the prefill servers (one per
    address record: a Kubernetes headless Service). Excludes ``prefill_urls``."""
    prefill_routing: str = "prefix"
    """Decode role with several prefill servers: ``prefix`` sends a prompt to the server that was
    sent the longest run of its leading blocks while its load allows (``serving.prefill_router``),
    ``least_loaded`` to the one with the fewest calls in flight."""
    prefill_call_timeout_s: float = 60.0
    """Decode role with remote prefill: the gRPC deadline of one prefill call, which is how a
    prefill server that went silent (a cut link) is noticed; the call then fails over."""
    advertise_host: str = ""
    """The address of this host that remote readers dial for KV (``nixl``); empty: what the
    host name resolves to."""
    kv_transfer_timeout_s: float = 10.0
    """How long decode waits for one request's KV to arrive over the network (``nixl``)
    before it abandons the transfer (then ``kv_load_failure_policy`` applies)."""
    kv_transfer_dtype: str = "auto"
    """``nixl``: how prefill's blocks cross the network: ``auto`` in the pool's dtype, ``fp8`` as
    e4m3 with a scale per block and head (about half of bfloat16's bytes; lossy). Decoding
    needs nothing of the reader: it follows the handle."""
    kv_stream_layers: bool = False
    """Prefill servers (``--role prefill``, ``nixl``): answer with the KV handle before the
    prompt pass and announce each layer as it is written, so that decode pulls the KV while the
    pass runs (``prefill`` is then a decoupled model). Off: the handle after the pass."""
    kv_stream_min_tokens: int = 256
    """With ``kv_stream_layers``: prompts shorter than this are answered whole, after the pass
    (their transfer is short, and streaming's per-layer work lengthened short passes:
    BENCHMARKS.md, "Layer-wise KV streaming")."""
    kv_stream_min_gap_s: float = 0.05
    """Prefill servers on CPUs: a pass that streams or pushes its KV hands its written layers on
    (one announcement, one WRITE each time) at most once per this much of the pass, the last
    layer at once (``serving.layer_chunks``); 0: layer by layer, as on GPUs always."""
    kv_push: bool = False
    """Decode servers (``--role decode``, ``nixl``): reserve a prompt's blocks before calling
    prefill and let prefill WRITE each layer into them as its pass writes it, answering once all
    are in (``serving.layer_push``): no handle to pull, no per-layer announcement. Prefill's
    fp8 pushes need ``kv_transfer_dtype=fp8`` here too (they land in a wire copy)."""
    kv_load_failure_policy: str = "recompute"
    """Decode, when a handed-over request's KV cannot be pulled (lease expired, owner gone,
    transfer past its deadline): ``recompute`` its prompt here, or ``fail`` it with
    UNAVAILABLE (the default of ``--role decode``, whose cores are sized for decode)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        positive = (
            "lease_ttl_s",
            "default_max_tokens",
            "prefill_retry_s",
            "cancel_poll_s",
            "metrics_interval_s",
            "kv_transfer_timeout_s",
            "prefill_call_timeout_s",
            "tpot_target_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.kv_transfer_dtype not in ("auto", "fp8"):
            raise ValueError(
                f"kv_transfer_dtype must be auto or fp8, got {self.kv_transfer_dtype!r}"
            )
        if self.kv_transfer_dtype == "fp8" and self.transport != "nixl":
            raise ValueError("kv_transfer_dtype fp8 needs transport nixl (KV across machines)")
        if self.prefill_routing not in PREFILL_ROUTING:
            raise ValueError(
                f"prefill_routing must be one of {PREFILL_ROUTING}, got {self.prefill_routing!r}"
            )
        if self.kv_stream_min_tokens < 0:
            raise ValueError("kv_stream_min_tokens must be >= 0")
        if self.kv_stream_min_gap_s < 0:
            raise ValueError("kv_stream_min_gap_s must be >= 0")
        if self.kv_stream_layers and self.transport != "nixl":
            raise ValueError("kv_stream_layers needs transport nixl (KV across machines)")
        if self.kv_push and (self.transport != "nixl" or not self.remote_prefill):
            raise ValueError(
                "kv_push applies to decode servers with remote prefill over nixl (--role decode)"
            )
        if self.kv_load_failure_policy not in HANDOFF_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {HANDOFF_FAILURE_POLICIES}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0 (0: no bound)")
        if self.request_timeout_s is not None and not 0 < self.request_timeout_s < float("inf"):
            raise ValueError("request_timeout_s must be positive and finite (or None: no deadline)")
        parse_core_sets(self.cpu_cores)
        if self.prefill_urls and self.prefill_dns:
            raise ValueError("prefill_urls and prefill_dns exclude each other")
        if (self.prefill_urls or self.prefill_dns) and self.role != "decode":
            raise ValueError("prefill_urls and prefill_dns apply to the decode role")
        shares = self.role in ("prefill", "decode") and bool(self.core_lock)
        if self.core_lock and not shares:
            raise ValueError("core_lock applies to the prefill and decode roles")
        if self.lent_cores and not shares:
            raise ValueError("lent_cores applies to the prefill and decode roles with a core_lock")
        if self.lend_cores and not (shares and self.role == "decode"):
            raise ValueError("lend_cores applies to the decode role with a core_lock")
        if self.role == "decode" and shares and not (self.lent_cores or self.lend_cores):
            raise ValueError("core_lock on the decode role needs lent_cores or lend_cores")
        if len(parse_core_sets(self.lent_cores)) > 1:
            raise ValueError("lent_cores: one core set (the other role's instance's)")

    def to_json(self) -> str:
        """This config as the one JSON parameter a stub reads (``CONFIG_PARAMETER``)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServingConfig:
        """The config a stub was rendered with; every key and value checked against its type."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{CONFIG_PARAMETER}: expected a JSON object")
        return build(cls, data, where=CONFIG_PARAMETER, nested={"engine": EngineConfig})

    @property
    def remote_prefill(self) -> bool:
        return bool(self.prefill_urls or self.prefill_dns)

    def transport_options(self) -> dict[str, object]:
        """Constructor options of this role's KV transport beyond the key."""
        options: dict[str, object] = {"lease_ttl_s": self.lease_ttl_s}
        if self.transport == "nixl":
            options["advertise_host"] = self.advertise_host or None
            options["transfer_timeout_s"] = self.kv_transfer_timeout_s
            options["transfer_dtype"] = self.kv_transfer_dtype
            options["accept_pushes"] = self.kv_push
            # A reader gives a READ up at its transfer timeout, so an owner whose reader died
            # mid-read need not keep the blocks for the default minute.
            options["pull_ttl_s"] = self.kv_transfer_timeout_s + PULL_MARGIN_S
        return options

    @property
    def lent_core_set(self) -> set[int]:
        sets = parse_core_sets(self.lent_cores)
        return sets[0] if sets else set()

    def cores_for(self, instance_index: int) -> set[int] | None:
        sets = parse_core_sets(self.cpu_cores)
        return sets[instance_index % len(sets)] if sets else None


def parse_core_sets(spec: str) -> list[set[int]]:
    """``"0-1;2"`` -> ``[{0, 1}, {2}]``: one core set per instance."""
    sets = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        try:
            sets.append(parse_cores(part))
        except ValueError as exc:
            raise ValueError(f"cpu_cores: {exc}") from None
    return sets


def pin_to_cores(cores: set[int] | None, num_threads: int | None) -> None:
    """Restrict this thread to ``cores`` (else to every allowed core: a stub restarted after the
    launcher narrowed the server's affinity inherits the narrow set) and size torch's thread
    pool to match."""
    import torch

    os.sched_setaffinity(0, cores or allowed_cores())
    threads = num_threads or (len(cores) if cores else None)
    if threads:
        torch.set_num_threads(threads)
