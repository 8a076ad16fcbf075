"""Which CPU a profile was measured on: vendor, family, model, stepping and ISA flags from
``/proc/cpuinfo``. Parts sold under one name differ (two AMD EPYC parts seen here run bf16
matmuls 2.3x apart), so a profile and a benchmark row name the part, not the brand."""

from __future__ import annotations

import platform
from pathlib import Path

FIELDS = {"vendor_id": "vendor", "cpu family": "family", "model": "model", "stepping": "stepping"}
"""``/proc/cpuinfo`` keys kept, and their names in the profile."""


def parse_cpuinfo(text: str) -> dict[str, str | list[str]]:
    """The first processor's name, vendor, family, model, stepping and sorted flags."""
    info: dict[str, str | list[str]] = {}
    for line in text.splitlines():
        if not line.strip():
            if info:
                break  # the first processor's block ended
            continue
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name":
            info["name"] = value
        elif key in FIELDS:
            info[FIELDS[key]] = value
        elif key == "flags":
            info["flags"] = sorted(value.split())
    return info


def cpu_identity(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str | list[str]]:
    """This machine's CPU as ``parse_cpuinfo`` gives it (only a name where there is no
    ``/proc/cpuinfo``)."""
    try:
        return parse_cpuinfo(cpuinfo.read_text())
    except OSError:
        return {"name": platform.processor() or platform.machine()}


def cpu_label(identity: dict[str, str | list[str]]) -> str:
    """E.g. "AMD EPYC (AuthenticAMD family 25 model 17)": the name, then the part."""
    name = str(identity.get("name", "unknown CPU"))
    if "family" not in identity:
        return name
    return (
        f"{name} ({identity.get('vendor', '?')} family {identity['family']} model "
        f"{identity.get('model', '?')})"
    )
