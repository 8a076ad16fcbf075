"""Per-request sampling and stopping parameters (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

SEED_MAX = 2**64 - 1
"""Seeds are in ``[0, SEED_MAX]``: what ``llm`` hands ``prefill`` as a UINT64 tensor, so both
serving modes take the same seeds."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_types()
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0.0, "must be non-negative"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 0, "must be -1 (disabled) or >= 0"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("seed", self.seed is None or 0 <= self.seed <= SEED_MAX, "must be in [0, 2**64 - 1]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be positive"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            (
                "stop_token_ids",
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "must be non-negative token ids",
            ),
        ]
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"{name} {what}, got {getattr(self, name)!r}")

    def _check_types(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "seed" and value is None:
                continue
            if f.type in ("int", "int | None") and not _is_int(value):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")
            if f.type == "float":
                if not (_is_int(value) or isinstance(value, float)):
                    raise ValueError(f"{f.name} must be a number, got {value!r}")
                setattr(self, f.name, float(value))
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be a boolean, got {value!r}")
            if f.type.startswith("list") and not isinstance(value, list):
                raise ValueError(f"{f.name} must be a list, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
