"""The saved profile: latency fits per instance size on one machine, and what they were taken on.

``units`` maps the cores (``device: cpu``) or GPUs (``device: gpu``) of one instance to the
fits measured with that many. ``modelled`` marks a profile computed from a device's datasheet
instead of measured; every report shows it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from splitserve_tools.planner.fit import (
    DecodeFit,
    DecodeSample,
    HandoffFit,
    PrefillFit,
    PrefillSample,
)
from splitserve_tools.planner.json_file import write_json

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ModelShape:
    """What the simulator needs to know of the model besides its step times."""

    kv_bytes_per_token: int
    block_size: int
    max_model_len: int
    weight_bytes: int


@dataclass(frozen=True)
class ServingOverhead:
    """Costs of the Triton pipeline around the engine, in seconds."""

    token_s: float = 0.0
    """Per streamed token, paid by the instance that sends it (one response through the
    Python backend's IPC)."""
    request_s: float = 0.0
    """Per request before its first token (parsing, tokenizing, the BLS call to prefill)."""
    pass_factor: float = 1.0
    """A served prompt pass over the profiled one, with no neighbour busy: the server's own
    threads share the instance's cores (fitted across nodes by ``served_pass``)."""
    stream_pass_factor: float = 1.0
    """How much longer again a pass runs while it streams its KV by layer: the transfers'
    work (the transport's threads, the network stack) shares the prefill host's cores."""


@dataclass(frozen=True)
class Contention:
    """How much longer a step takes while the instances on the other cores are in steps of
    their own: 0.25 is 25 % longer when all of them are busy, in proportion when some are.
    Cores share memory bandwidth and caches, and the server's and the client's own threads
    run on them too; fitted on the real server (``splitserve_tools.planner.calibrate``). Zero for
    GPUs, whose instances share nothing."""

    prefill: float = 0.0
    decode: float = 0.0


@dataclass(frozen=True)
class Rates:
    """What the hardware of one instance does at best, whatever the engine: the roofline."""

    read_bytes_per_s: float
    matmul_flops: float
    """FLOP/s of a large matmul in the profile's dtype."""


@dataclass(frozen=True)
class UnitProfile:
    """Fits for one instance size, and the samples they were fitted to."""

    threads: int
    prefill: PrefillFit
    decode: DecodeFit
    prefill_samples: tuple[PrefillSample, ...] = ()
    decode_samples: tuple[DecodeSample, ...] = ()
    rates: Rates | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "threads": self.threads,
            "prefill": self.prefill.to_dict(),
            "decode": self.decode.to_dict(),
            "prefill_samples": [asdict(s) for s in self.prefill_samples],
            "decode_samples": [asdict(s) for s in self.decode_samples],
            "rates": asdict(self.rates) if self.rates else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UnitProfile:
        return cls(
            threads=int(d["threads"]),
            prefill=PrefillFit.from_dict(d["prefill"]),
            decode=DecodeFit.from_dict(d["decode"]),
            prefill_samples=tuple(PrefillSample(**s) for s in d.get("prefill_samples", [])),
            decode_samples=tuple(DecodeSample(**s) for s in d.get("decode_samples", [])),
            rates=Rates(**d["rates"]) if d.get("rates") else None,
        )


@dataclass(frozen=True)
class Profile:
    model: str
    device: str
    dtype: str
    modelled: bool
    hardware: dict[str, Any]
    shape: ModelShape
    handoff: HandoffFit
    units: dict[int, UnitProfile]
    serving: ServingOverhead = field(default_factory=ServingOverhead)
    contention: Contention = field(default_factory=Contention)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {self.device!r}")
        if not self.units:
            raise ValueError("a profile needs fits for at least one instance size")

    @property
    def unit_name(self) -> str:
        return "cores" if self.device == "cpu" else "GPUs"

    def unit(self, n: int) -> UnitProfile:
        if n not in self.units:
            have = sorted(self.units)
            raise KeyError(f"no fits for {n} {self.unit_name} per instance (have {have})")
        return self.units[n]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "modelled": self.modelled,
            "hardware": self.hardware,
            "shape": asdict(self.shape),
            "handoff": self.handoff.to_dict(),
            "serving": asdict(self.serving),
            "contention": asdict(self.contention),
            "units": {str(n): u.to_dict() for n, u in sorted(self.units.items())},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"profile format {d.get('version')!r}, expected {FORMAT_VERSION}")
        return cls(
            model=d["model"],
            device=d["device"],
            dtype=d["dtype"],
            modelled=bool(d["modelled"]),
            hardware=dict(d["hardware"]),
            shape=ModelShape(**d["shape"]),
            handoff=HandoffFit.from_dict(d["handoff"]),
            units={int(n): UnitProfile.from_dict(u) for n, u in d["units"].items()},
            serving=ServingOverhead(**d.get("serving", {})),
            contention=Contention(**d.get("contention", {})),
        )

    def save(self, path: Path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))


def with_costs_of(profile: Profile, calibrated: Profile) -> Profile:
    """``profile`` with the serving costs and contention of ``calibrated``, a calibrated profile
    of another model on the same machine: those costs belong to the server and the machine more
    than to the model. Refused where the two profiles name different CPUs or devices."""
    if (profile.device, profile.hardware.get("cpu_id")) != (
        calibrated.device,
        calibrated.hardware.get("cpu_id"),
    ):
        raise ValueError(
            "the calibrated profile is of another machine "
            f"({calibrated.hardware.get('cpu')} vs {profile.hardware.get('cpu')})"
        )
    return replace(profile, serving=calibrated.serving, contention=calibrated.contention)
