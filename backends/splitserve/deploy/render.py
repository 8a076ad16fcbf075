"""Render the Triton model repository for a layout from the templates in ``model_repository/``.

The same templates serve both devices: ``KIND_CPU`` instances pinned to core sets, or
``KIND_GPU`` instances with ``gpus: [...]`` (Triton starts ``instances`` stubs on *each* listed
GPU and tells every stub its GPU in ``model_instance_device_id``). On GPUs the engine runs on
``cuda`` and prefill hands KV to decode over CUDA IPC.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from string import Template

LAYOUTS: dict[str, tuple[str, ...]] = {
    "disagg": ("llm", "prefill"),
    "colocated": ("llm_colocated",),
    "both": ("llm", "prefill", "llm_colocated"),
}
ROLE_OF = {"llm": "decode", "prefill": "prefill", "llm_colocated": "colocated"}
GPU_TRANSPORT = "cuda_ipc"


def parse_gpus(spec: str) -> tuple[int, ...]:
    """``"0"``, ``"0,1"`` or ``"0-3"`` -> sorted distinct GPU ids."""
    ids: set[int] = set()
    for item in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = item.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"cannot read GPU ids {spec!r} (e.g. '0', '0,1' or '0-3')") from None
        if first < 0 or last < first:
            raise ValueError(f"bad GPU range {item!r} in {spec!r}")
        ids.update(range(first, last + 1))
    if not ids:
        raise ValueError(f"no GPU ids in {spec!r}")
    return tuple(sorted(ids))


def templates_dir() -> Path:
    """``$SPLITSERVE_TEMPLATES``, else ``model_repository/`` of the source tree."""
    env = os.environ.get("SPLITSERVE_TEMPLATES")
    path = Path(env) if env else Path(__file__).resolve().parents[3] / "model_repository"
    if not (path / "generate_io.pbtxt").is_file():
        raise FileNotFoundError(f"model repository templates not found at {path}")
    return path


@dataclass(frozen=True)
class RoleSpec:
    instances: int = 1
    cpu_cores: str = ""
    """Per-instance core sets, ``;``-separated (see ServingConfig.cpu_cores)."""
    gpus: tuple[int, ...] = ()
    """GPU ids (device ``gpu``); ``instances`` instances run on each of them."""
    params: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.instances <= 0:
            raise ValueError("instances must be positive")
        if len(set(self.gpus)) != len(self.gpus) or any(g < 0 for g in self.gpus):
            raise ValueError(f"GPU ids must be distinct and non-negative, got {list(self.gpus)}")


@dataclass(frozen=True)
class Layout:
    layout: str = "both"
    device: str = "cpu"
    engine: dict[str, str] = field(default_factory=lambda: {"model": "tiny"})
    """Parameters every role gets (EngineConfig fields: model, dtype, max_model_len, ...)."""
    prefill: RoleSpec = RoleSpec()
    decode: RoleSpec = RoleSpec()
    colocated: RoleSpec = RoleSpec()
    prefill_max_batch_size: int = 8
    prefill_queue_delay_us: int = 1000

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {self.layout!r}")
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {self.device!r}")
        for model in LAYOUTS[self.layout]:
            role = ROLE_OF[model]
            gpus = self.role(role).gpus
            if self.device == "gpu" and not gpus:
                raise ValueError(f"device 'gpu' needs GPU ids for the {role} role")
            if self.device == "cpu" and gpus:
                raise ValueError(f"the {role} role lists GPUs {list(gpus)} but device is 'cpu'")

    def role(self, name: str) -> RoleSpec:
        return getattr(self, name)


def default_cpu_layout(layout: str, engine: dict[str, str], cores: int | None = None) -> Layout:
    """Prefill on the first half of the cores, decode on the rest, colocated on all of them."""
    n = cores or len(os.sched_getaffinity(0))
    half = max(1, n // 2)
    prefill = f"0-{half - 1}" if n > 1 else "0"
    decode = f"{half}-{n - 1}" if n > 1 else "0"
    return Layout(
        layout=layout,
        engine=engine,
        prefill=RoleSpec(cpu_cores=prefill),
        decode=RoleSpec(cpu_cores=decode),
        colocated=RoleSpec(cpu_cores=f"0-{n - 1}"),
    )


def lending_refusal(layout: Layout) -> str | None:
    """Why the prefill instance of ``layout`` cannot lend its cores to decode, or None."""
    from splitserve.serving.serving_config import parse_core_sets

    if layout.device != "cpu" or "prefill" not in LAYOUTS[layout.layout]:
        return "lending prefill cores needs a CPU layout with prefill and decode"
    if layout.prefill.instances != 1 or layout.decode.instances != 1:
        return "lending prefill cores needs one prefill and one decode instance"
    prefill = parse_core_sets(layout.prefill.cpu_cores)
    own = parse_core_sets(layout.decode.cpu_cores)
    if len(prefill) != 1 or len(own) != 1 or prefill[0] & own[0]:
        return (
            "lending prefill cores needs one core set per role, with no core in both "
            f"(prefill {layout.prefill.cpu_cores!r}, decode {layout.decode.cpu_cores!r})"
        )
    return None


def default_server_cores(layout: Layout) -> set[int] | None:
    """Where tritonserver's own threads go by default: on CPUs, the prefill instances' cores,
    away from decode's engine threads, whose steps pace every stream (TPOT); None (anywhere)
    for GPU layouts and layouts without prefill."""
    from splitserve.serving.serving_config import parse_core_sets

    if layout.device != "cpu" or "prefill" not in LAYOUTS[layout.layout]:
        return None
    cores = set().union(*parse_core_sets(layout.prefill.cpu_cores))
    return cores or None


def lend_prefill_cores(layout: Layout, lock_path: str) -> Layout:
    """The layout with its one prefill instance lending its cores to its one decode instance
    between prompt passes (``serving.core_lend``): decode keeps its own cores' threads and adds
    the prefill cores' for each step that starts while prefill is idle."""
    refusal = lending_refusal(layout)
    if refusal is not None:
        raise ValueError(refusal)
    lock = {"core_lock": lock_path}
    lent = {**lock, "lent_cores": layout.prefill.cpu_cores}
    return replace(
        layout,
        prefill=replace(layout.prefill, params={**layout.prefill.params, **lock}),
        decode=replace(layout.decode, params={**layout.decode.params, **lent}),
    )


def default_gpu_layout(
    layout: str,
    engine: dict[str, str],
    prefill_gpus: tuple[int, ...] = (0,),
    decode_gpus: tuple[int, ...] = (0,),
    colocated_gpus: tuple[int, ...] | None = None,
) -> Layout:
    """One instance per listed GPU and role; ``llm_colocated`` defaults to every GPU used.

    Prefill and decode may share a GPU (two processes, KV still handed over by IPC)."""
    colocated = colocated_gpus or tuple(sorted({*prefill_gpus, *decode_gpus}))
    return Layout(
        layout=layout,
        device="gpu",
        engine=engine,
        prefill=RoleSpec(gpus=prefill_gpus),
        decode=RoleSpec(gpus=decode_gpus),
        colocated=RoleSpec(gpus=colocated),
    )


def model_values(layout: Layout, model: str) -> dict[str, str]:
    """The ``parameters`` of one model's config: engine fields, role params, placement."""
    role = ROLE_OF[model]
    spec = layout.role(role)
    values = {**layout.engine, **spec.params}
    if layout.device == "gpu":
        values["device"] = "cuda"
        if role in ("prefill", "decode"):
            values.setdefault("transport", GPU_TRANSPORT)
    elif spec.cpu_cores:
        values["cpu_cores"] = spec.cpu_cores
    return values


def _parameters(values: dict[str, str]) -> str:
    rows = [
        f'  {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in sorted(values.items())
    ]
    return ",\n".join(rows)


def render(layout: Layout, out_dir: Path, templates: Path | None = None) -> Path:
    """Write one Triton model directory per model of the layout into ``out_dir``."""
    src = templates or templates_dir()
    generate_io = (src / "generate_io.pbtxt").read_text()
    out_dir.mkdir(parents=True, exist_ok=True)
    for model in LAYOUTS[layout.layout]:
        spec = layout.role(ROLE_OF[model])
        values = model_values(layout, model)
        gpus = f" gpus: [ {', '.join(map(str, spec.gpus))} ]" if spec.gpus else ""
        text = Template((src / model / "config.pbtxt.tmpl").read_text()).substitute(
            generate_io=generate_io.strip(),
            instances=spec.instances,
            kind="KIND_GPU" if layout.device == "gpu" else "KIND_CPU",
            gpus=gpus,
            parameters=_parameters(values),
            max_batch_size=layout.prefill_max_batch_size,
            queue_delay_us=layout.prefill_queue_delay_us,
        )
        dst = out_dir / model
        (dst / "1").mkdir(parents=True, exist_ok=True)
        (dst / "config.pbtxt").write_text(text)
        shutil.copy(src / model / "1" / "model.py", dst / "1" / "model.py")
    return out_dir
