"""Where the CPU kernels build, and recovery from a build that was killed half way."""

from __future__ import annotations

from pathlib import Path

import torch.utils.cpp_extension

from splitserve_kernels import cpu


def test_build_dir_is_per_checkout_under_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    where = cpu.build_dir()
    assert where.parent.parent == tmp_path
    assert where.name.startswith("splitserve_cpu_kernels-")
    assert where == cpu.build_dir()


def test_a_stale_torch_lock_is_removed_before_the_build(tmp_path, monkeypatch):
    """torch waits forever on a ``lock`` file whose builder died; our own lock proves it dead."""
    (tmp_path / "lock").touch()
    seen: list[bool] = []

    def fake_load(name: str, sources: list[str], **kwargs: object) -> str:
        assert Path(str(kwargs["build_directory"])) == tmp_path
        seen.append((tmp_path / "lock").exists())
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    assert cpu._load(tmp_path) == "module"
    assert seen == [False]


def test_build_creates_its_directory(tmp_path, monkeypatch):
    where = tmp_path / "a" / "b"
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *a, **k: "module")
    assert cpu._load(where) == "module"
    assert (where / "splitserve.flock").exists()
