"""The CPU a profile names: the part (vendor, family, model, stepping, flags), not the brand."""

from __future__ import annotations

from pathlib import Path

from splitserve_tools.planner.cpu_id import cpu_identity, cpu_label, parse_cpuinfo

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu avx2 avx512_bf16 avx512f

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 99
model name\t: another
"""


def test_the_first_processor_is_named_by_its_part() -> None:
    info = parse_cpuinfo(CPUINFO)
    assert info == {
        "vendor": "AuthenticAMD",
        "family": "25",
        "model": "17",
        "name": "AMD EPYC",
        "stepping": "1",
        "flags": ["avx2", "avx512_bf16", "avx512f", "fpu"],
    }
    assert cpu_label(info) == "AMD EPYC (AuthenticAMD family 25 model 17)"


def test_without_cpuinfo_only_a_name(tmp_path: Path) -> None:
    info = cpu_identity(tmp_path / "missing")
    assert set(info) == {"name"} and cpu_label(info) == info["name"]


def test_this_machine() -> None:
    info = cpu_identity()
    assert info.get("name")
    if Path("/proc/cpuinfo").is_file():
        assert {"vendor", "family", "model", "flags"} <= set(info)
