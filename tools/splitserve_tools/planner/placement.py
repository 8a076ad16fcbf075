"""One candidate deployment: which roles run, how many instances of how many cores/GPUs each,
and the batching limits they run with."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MODES = ("disagg", "colocated")


@dataclass(frozen=True)
class Role:
    instances: int
    units: int
    """Cores (CPU) or GPUs per instance."""

    def __post_init__(self) -> None:
        if self.instances <= 0 or self.units <= 0:
            raise ValueError(f"instances and units must be positive, got {self}")

    @property
    def devices(self) -> int:
        return self.instances * self.units


@dataclass(frozen=True)
class Limits:
    prefill_max_batch_size: int = 8
    """Triton dynamic batcher of ``prefill``: requests per batch."""
    prefill_queue_delay_s: float = 0.001
    """... and how long the oldest waits for more before a partial batch goes."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    chunked_prefill: bool = False
    """Colocated engines: split long prompts over steps within ``max_num_batched_tokens``."""
    kv_cache_bytes: int = 512 << 20
    """KV pool of each instance."""
    prefix_cache: bool = True
    """Instances reuse the KV of cached prompt prefixes, as the server does by default."""
    lend_cores: bool = True
    """A CPU split of one prefill and one decode instance lends cores both ways, as the server
    does by default (``serving.core_lend``, ``serving.decode_lend``)."""
    tpot_target_s: float = 0.1
    """Decode's ``tpot_target_s``: it lends its cores to passes while its steps leave room."""

    def __post_init__(self) -> None:
        for name in ("prefill_max_batch_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.prefill_queue_delay_s < 0 or self.kv_cache_bytes <= 0:
            raise ValueError("queue delay must be >= 0 and kv_cache_bytes positive")
        if self.tpot_target_s <= 0:
            raise ValueError("tpot_target_s must be positive")


@dataclass(frozen=True)
class Placement:
    mode: str
    prefill: Role | None = None
    decode: Role | None = None
    colocated: Role | None = None
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        disagg = self.prefill is not None and self.decode is not None
        if self.mode == "disagg" and not (disagg and self.colocated is None):
            raise ValueError("a disagg placement has prefill and decode roles only")
        if self.mode == "colocated" and (self.colocated is None or self.prefill or self.decode):
            raise ValueError("a colocated placement has the colocated role only")

    def roles(self) -> dict[str, Role]:
        named = {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}
        return {name: role for name, role in named.items() if role is not None}

    @property
    def devices(self) -> int:
        return sum(role.devices for role in self.roles().values())

    def describe(self, unit: str = "units") -> str:
        parts = [f"{n} {r.instances}x{r.units}" for n, r in self.roles().items()]
        lim = self.limits
        knobs = [f"seqs {lim.max_num_seqs}"]
        if self.mode == "disagg":
            knobs.insert(0, f"pbatch {lim.prefill_max_batch_size}")
        elif lim.chunked_prefill:
            knobs.append(f"chunk {lim.max_num_batched_tokens}")
        return f"{self.mode}: {', '.join(parts)} {unit} ({', '.join(knobs)})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "roles": {n: asdict(r) for n, r in self.roles().items()},
            "limits": asdict(self.limits),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Placement:
        roles = {n: Role(**r) for n, r in d["roles"].items()}
        return cls(mode=d["mode"], limits=Limits(**d.get("limits", {})), **roles)
