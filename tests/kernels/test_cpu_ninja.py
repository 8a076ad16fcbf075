"""torch builds the CPU kernels by running ``ninja`` from PATH; the ``ninja`` wheel's binary sits in
the venv's ``bin``, which is not on PATH when the venv is not activated, and every process must
use the same one."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from splitserve_kernels import cpu


def fake_ninja(where: Path) -> Path:
    where.mkdir(parents=True)
    exe = where / "ninja"
    exe.write_text("#!/bin/sh\necho 1.11.1\n")
    exe.chmod(0o755)
    return where


def test_a_ninja_beside_the_interpreter_goes_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = fake_ninja(tmp_path / "venv" / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(cpu, "_ninja_dirs", lambda: [tmp_path / "nowhere", bin_dir])
    cpu.ensure_ninja()
    assert os.environ["PATH"].split(os.pathsep)[0] == str(bin_dir)
    assert shutil.which("ninja") == str(bin_dir / "ninja")


def test_the_wheels_ninja_goes_first_even_with_another_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stubs (PATH starts with the venv) and callers must run one ninja: two versions read each
    other's build log as stale and rebuild every object."""
    on_path = fake_ninja(tmp_path / "usr" / "bin")
    wheel = fake_ninja(tmp_path / "venv" / "bin")
    monkeypatch.setenv("PATH", str(on_path))
    monkeypatch.setattr(cpu, "_ninja_dirs", lambda: [wheel])
    cpu.ensure_ninja()
    cpu.ensure_ninja()
    assert os.environ["PATH"] == os.pathsep.join([str(wheel), str(on_path)])


def test_without_the_wheel_path_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    on_path = fake_ninja(tmp_path / "usr" / "bin")
    monkeypatch.setenv("PATH", str(on_path))
    monkeypatch.setattr(cpu, "_ninja_dirs", lambda: [tmp_path / "nowhere"])
    cpu.ensure_ninja()
    assert os.environ["PATH"] == str(on_path)


def test_the_interpreters_directory_is_a_candidate() -> None:
    assert Path(sys.executable).parent in cpu._ninja_dirs()
