"""Render the Triton model repository of a deployment spec from the templates.

The same templates serve both devices: ``KIND_CPU`` instances pinned to core sets, or
``KIND_GPU`` instances with ``gpus: [...]`` (Triton starts ``instances`` stubs on *each* listed
GPU and tells every stub its GPU in ``model_instance_device_id``). Each model's stubs get their
``ServingConfig`` as one JSON parameter, escaped for the protobuf text format.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from string import Template

from splitserve.deploy.spec import ROLE_OF, DeploymentSpec
from splitserve.serving.serving_config import CONFIG_PARAMETER


def templates_dir() -> Path:
    """``$SPLITSERVE_TEMPLATES``, else the ``templates/`` shipped beside this module (package
    data of the wheel)."""
    env = os.environ.get("SPLITSERVE_TEMPLATES")
    path = Path(env) if env else Path(__file__).resolve().parent / "templates"
    if not (path / "generate_io.pbtxt").is_file():
        raise FileNotFoundError(f"model repository templates not found at {path}")
    return path


def pbtxt_string(text: str) -> str:
    """``text`` as a quoted protobuf text-format string."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def parameters(spec: DeploymentSpec, model: str, repo_dir: Path) -> str:
    """The ``parameters`` block of one model's config: its ServingConfig as JSON."""
    key = pbtxt_string(CONFIG_PARAMETER)
    config = pbtxt_string(spec.serving_config(model, repo_dir).to_json())
    return f"  {{ key: {key} value: {{ string_value: {config} }} }}"


def render(spec: DeploymentSpec, out_dir: Path, templates: Path | None = None) -> Path:
    """Write one Triton model directory per model of the spec into ``out_dir``."""
    src = templates or templates_dir()
    generate_io = (src / "generate_io.pbtxt").read_text()
    out_dir.mkdir(parents=True, exist_ok=True)
    for model in spec.models:
        role = spec.role(ROLE_OF[model])
        gpus = f" gpus: [ {', '.join(map(str, role.gpus))} ]" if role.gpus else ""
        text = Template((src / model / "config.pbtxt.tmpl").read_text()).substitute(
            generate_io=generate_io.strip(),
            instances=role.instances,
            kind="KIND_GPU" if spec.device == "gpu" else "KIND_CPU",
            gpus=gpus,
            parameters=parameters(spec, model, out_dir.resolve()),
            max_batch_size=spec.prefill_max_batch_size,
            queue_delay_us=spec.prefill_queue_delay_us,
            decoupled=str(spec.serving_config(model, out_dir).kv_stream_layers).lower(),
        )
        dst = out_dir / model
        (dst / "1").mkdir(parents=True, exist_ok=True)
        (dst / "config.pbtxt").write_text(text)
        shutil.copy(src / model / "1" / "model.py", dst / "1" / "model.py")
    return out_dir
