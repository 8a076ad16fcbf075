"""C++ kernels for CPUs (decode and prefill attention, RMSNorm, rotary + KV write, SwiGLU,
greedy token choice, FP8 transfer encoding of KV blocks, linear layers with half-precision
weights widened to float), compiled on first use with the local compiler (g++ and ninja; the
sources ship in the wheel).

The build (a minute or more on a small machine; README) is cached under
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), in a directory per installed
copy of these sources, and reused by every later process; a source change rebuilds it.
``python -m splitserve_kernels.build`` builds it ahead of time (at install, in an image). Builds
take a file lock of their own, so a build that was killed half way (which leaves torch's ``lock``
file behind) no longer makes later loads wait forever. ``SPLITSERVE_KERNELS=reference`` turns
them off. Where the build fails, ``extension()`` is None, one warning per process names why, and
the dispatcher uses the pure-torch references instead; ``status()`` says which run.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = [
    _HERE / name
    for name in (
        "module.cpp",
        "paged_attention.cpp",
        "prefill_attention.cpp",
        "norm.cpp",
        "rotary.cpp",
        "activation.cpp",
        "argmax.cpp",
        "fp8.cpp",
        "widened_linear.cpp",
    )
]
_HEADERS = [_HERE / "vec.h", _HERE / "dtypes.h", _HERE / "scratch.h"]
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What the kernels take; other dtypes use the references."""
NATIVE_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}
"""``/proc/cpuinfo`` flags of instructions that multiply the dtype without widening it."""


def usable(t: torch.Tensor) -> bool:
    """Whether the kernels here take ``t``: a CPU tensor of one of DTYPES, the build done."""
    return t.device.type == "cpu" and t.dtype in DTYPES and extension() is not None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's ISA flags (``/proc/cpuinfo``; none where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def native_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` in hardware (float32 always); where not, the
    matmul libraries widen it at a fraction of float32's rate and ``widened_linear`` is faster."""
    flags = NATIVE_FLAGS.get(dtype)
    return flags is None or any(flag in cpu_flags() for flag in flags)


def enabled() -> bool:
    return os.environ.get("SPLITSERVE_KERNELS") != "reference"


def _headers_digest() -> str:
    """Torch rebuilds when a source or a flag changes, not a header: the headers' digest goes
    into a flag."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in _HEADERS))
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """Where this checkout's build lives: one directory per source location, so two checkouts
    (a clone under test beside the working tree) do not rebuild each other's objects."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", cache / "torch_extensions"))
    tag = hashlib.sha256(str(_HERE.resolve()).encode()).hexdigest()[:8]
    py = f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    return root / py / f"splitserve_cpu_kernels-{tag}"


def _ninja_dirs() -> list[Path]:
    """Where the ``ninja`` of the ``ninja`` wheel may be: its own idea, its installed files, and
    beside this interpreter (a venv's ``bin``, not on PATH unless the venv is activated)."""
    dirs = []
    try:
        import ninja

        if getattr(ninja, "BIN_DIR", ""):
            dirs.append(Path(ninja.BIN_DIR))
    except ImportError:
        pass
    try:
        files = importlib.metadata.files("ninja") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    dirs += [Path(str(f.locate())).resolve().parent for f in files if f.name == "ninja"]
    return [*dirs, Path(sys.executable).parent]


def ensure_ninja() -> None:
    """torch runs ``ninja`` from PATH: put the ``ninja`` wheel's first, so that every process
    (the server's stubs, whose PATH starts with the venv, and a caller's) builds with the same
    ninja; two versions read each other's build log as stale and rebuild everything. Without
    the wheel, whatever ninja PATH has."""
    for where in _ninja_dirs():
        if (where / "ninja").is_file() and os.access(where / "ninja", os.X_OK):
            path = os.environ.get("PATH", "")
            if not path.startswith(f"{where}{os.pathsep}"):
                os.environ["PATH"] = os.pathsep.join([str(where), path])
            return


def _load(where: Path, verbose: bool = False) -> ModuleType:
    """Build (or load) under an exclusive lock of our own. Every build goes through it, so a
    torch ``lock`` file found while holding it belongs to a build that died: remove it."""
    from torch.utils.cpp_extension import load

    ensure_ninja()
    where.mkdir(parents=True, exist_ok=True)
    with open(where / "splitserve.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = where / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink()
        return load(
            "splitserve_cpu_kernels",
            [str(p) for p in _SOURCES],
            extra_cflags=[*_FLAGS, f"-DSPLITSERVE_HEADERS={_headers_digest()}"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(where),
            verbose=verbose,
        )


_why_not: str | None = None
"""Why ``extension()`` is None, once it has been asked."""


@functools.cache
def extension() -> ModuleType | None:
    """The compiled module, or None where kernels are off or the build failed (then one
    warning, naming why; ``status()`` says it too)."""
    global _why_not
    if not enabled():
        _why_not = "turned off by SPLITSERVE_KERNELS=reference"
        log.info("CPU kernels %s: the torch references run", _why_not)
        return None
    log.info("loading the CPU kernels (compiled once, then cached)")
    try:
        ext = _load(build_dir())
    except Exception as exc:  # a missing compiler, ninja or headers: run on the reference instead
        _why_not = f"the build failed: {type(exc).__name__}: {exc}"
        log.warning(
            "CPU kernels unavailable, the slower torch references run instead (%s); "
            "`python -m splitserve_kernels.build` retries the build and shows its output",
            _why_not,
        )
        return None
    log.info("CPU kernels loaded from %s", ext.__file__)
    return ext


def status() -> str:
    """``compiled <path of the module>``, or ``reference (<why>)``; builds or loads the kernels
    first where that has not been tried in this process."""
    ext = extension()
    return f"compiled {ext.__file__}" if ext is not None else f"reference ({_why_not})"


def _ext() -> ModuleType:
    ext = extension()
    assert ext is not None
    return ext


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.attention.paged_decode_attention``, for CPU tensors; reads the
    cache in place. Only called where ``extension()`` built."""
    return _ext().paged_decode_attention(
        q, cache, layer, block_tables, seq_lens, scale, sliding_window or -1
    )


PREFILL_HEAD_DIMS = (32, 64, 128)
"""Head dims the prefill attention kernel is compiled for; others use the reference."""


def paged_prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    block_tables: list[torch.Tensor],
    cu_seqlens_q: list[int],
    cu_seqlens_k: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.attention.paged_prefill_attention``, for CPU tensors; reads
    the cache in place."""
    return _ext().paged_prefill_attention(
        q,
        cache,
        layer,
        block_tables,
        torch.tensor(cu_seqlens_q),
        torch.tensor(cu_seqlens_k),
        scale,
        sliding_window or -1,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``reference.norm.rms_norm`` for CPU tensors ``[..., hidden]``."""
    return _ext().rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.norm.add_rms_norm`` for CPU tensors ``[..., hidden]``."""
    flat = (x.reshape(-1, x.shape[-1]).contiguous(), residual.reshape(-1, x.shape[-1]).contiguous())
    out, total = _ext().add_rms_norm(*flat, weight, eps)
    return out.view(x.shape), total.view(x.shape)


def rotary_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    cache: torch.Tensor,
    layer: int,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> torch.Tensor:
    """``reference.rope.rotary_write_kv`` for CPU tensors, in one pass over the tokens."""
    return _ext().rotary_write_kv(
        qkv.contiguous(), cos, sin, heads, cache, layer, slot_blocks, slot_offsets
    )


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``reference.activation.silu_mul_`` for contiguous CPU tensors."""
    return _ext().silu_mul_(gate, up)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``reference.sampling.greedy_tokens`` for CPU tensors, read in their own dtype."""
    return _ext().greedy_tokens(logits)


def encode_blocks(
    pool: torch.Tensor,
    src_ids: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    """``reference.fp8.encode_blocks`` for CPU tensors."""
    _ext().fp8_encode_blocks(pool, src_ids, q, scales, dst_ids)


def decode_blocks(
    q: torch.Tensor,
    scales: torch.Tensor,
    src_ids: torch.Tensor,
    pool: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    """``reference.fp8.decode_blocks`` for CPU tensors."""
    _ext().fp8_decode_blocks(q, scales, src_ids, pool, dst_ids)


def widened_linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``reference.linear.widened_linear`` for CPU tensors."""
    return _ext().widened_linear(x, panels, bias, out_features)
