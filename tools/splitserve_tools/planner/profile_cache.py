"""Profiles cached per model shape, dtype and machine, for ``splitserve serve`` to plan from.

A profile times the engine, so it depends on the checkpoint's shape (its ``config.json``), not
on its weights or where it lies: the key is a digest of that file, beside the dtype, the device
and the machine (the CPU part from ``/proc/cpuinfo``, or the GPU's name). ``plan profile`` and
``plan calibrate`` store what they write here; ``serve`` without placement flags looks it up.
Searches are cached beside them, keyed by the profile's content and what was searched for.

The directory is ``$SPLITSERVE_PROFILE_CACHE``, else ``$XDG_CACHE_HOME/splitserve/profiles``,
else ``~/.cache/splitserve/profiles``; ``SPLITSERVE_PROFILE_CACHE=none`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from splitserve_tools.planner.cpu_id import cpu_identity
from splitserve_tools.planner.profile import Profile

ENV = "SPLITSERVE_PROFILE_CACHE"
OFF = "none"


def cache_dir() -> Path | None:
    """Where profiles are cached; None when the cache is off."""
    given = os.environ.get(ENV)
    if given is not None:
        return None if given.strip().lower() in (OFF, "") else Path(given)
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "splitserve" / "profiles"


def _digest(value: object, chars: int = 16) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:chars]


def model_key(model: str) -> str:
    """``tiny``, or a digest of the checkpoint's ``config.json`` (its shape)."""
    if model == "tiny":
        return "tiny"
    config = Path(model) / "config.json"
    try:
        return "config-" + _digest(json.loads(config.read_text()))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {config} to key its profile: {exc}") from None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_") or "unknown"


def machine_key(device: str, hardware: dict[str, Any]) -> str:
    """``cpu-<vendor>-<family>-<model>-<digest of the part and its flags>`` or ``gpu-<name>``."""
    if device == "gpu":
        return "gpu-" + _slug(str(hardware.get("gpu", "unknown")))
    part = hardware.get("cpu_id") or {}
    label = "-".join(_slug(str(part.get(k, "?"))) for k in ("vendor", "family", "model"))
    return f"cpu-{label}-{_digest(part, 8)}"


def this_machine(device: str) -> dict[str, Any]:
    """The hardware fields ``machine_key`` reads, of this machine (torch only for GPUs)."""
    if device == "gpu":
        import torch

        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        return {"gpu": name}
    return {"cpu_id": cpu_identity()}


def profile_path(root: Path, model: str, dtype: str, device: str, hardware: dict[str, Any]) -> Path:
    return root / machine_key(device, hardware) / f"{model_key(model)}-{dtype}.json"


def store(profile: Profile, model: str) -> Path | None:
    """Cache ``profile`` of checkpoint ``model`` (its last writer wins); None where the cache
    is off or the profile is modelled rather than measured."""
    root = cache_dir()
    if root is None or profile.modelled:
        return None
    path = profile_path(root, model, profile.dtype, profile.device, profile.hardware)
    profile.save(path)
    return path


def lookup(model: str, dtype: str, device: str) -> tuple[Path | None, Path | None]:
    """(the cached profile of ``model`` on this machine, or None; the path it would have)."""
    root = cache_dir()
    if root is None:
        return None, None
    path = profile_path(root, model, dtype, device, this_machine(device))
    return (path if path.is_file() else None), path


def plan_path(profile_file: Path, searched: dict[str, Any]) -> Path:
    """Where the search of ``profile_file`` for ``searched`` (workload, SLOs, budget) is cached:
    beside the profile, keyed by both, so that a new profile or other targets search again."""
    key = _digest({"profile": profile_file.read_text(), "searched": searched})
    return profile_file.parent / "plans" / f"{profile_file.stem}-{key}.json"
