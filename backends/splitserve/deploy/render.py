"""Render the Triton model repository for a layout from the templates in ``model_repository/``."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

LAYOUTS: dict[str, tuple[str, ...]] = {
    "disagg": ("llm", "prefill"),
    "colocated": ("llm_colocated",),
    "both": ("llm", "prefill", "llm_colocated"),
}
ROLE_OF = {"llm": "decode", "prefill": "prefill", "llm_colocated": "colocated"}


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
    params: dict[str, str] = field(default_factory=dict)


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
        values = {**layout.engine, **spec.params}
        if spec.cpu_cores and layout.device == "cpu":
            values["cpu_cores"] = spec.cpu_cores
        if layout.device == "gpu":
            values["device"] = "cuda"
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
