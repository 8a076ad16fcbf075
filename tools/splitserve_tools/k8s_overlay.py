"""A kustomize overlay for a plan (``splitserve plan search --k8s DIR``): the plan's replica
counts and CPU resources over one of the repository's ``deploy/k8s`` overlays."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

OVERLAYS = Path("deploy/k8s/overlays")
"""The ``cpu`` and ``gpu`` overlays, relative to the repository root."""
WORKLOADS = {"prefill": "splitserve-prefill", "decode": "splitserve-decode"}
"""Container name -> its Deployment (deploy/k8s/base)."""
CPU_QUANTITY = re.compile(r"^(\d+(\.\d+)?|\d+m)$")
"""What a CPU request may be here: whole or fractional cores, or millicores ("500m")."""


def overlay_dir(repo: Path, gpu: bool) -> Path:
    """The repository's overlay a plan builds on."""
    return repo / OVERLAYS / ("gpu" if gpu else "cpu")


def _resources_patch(container: str, cpu: str | None, gpu: bool) -> list[str]:
    """A strategic-merge patch of one Deployment's container resources, as YAML lines. CPU
    requests equal the limits: Guaranteed QoS, and the cpu overlay's thread count follows the
    limit."""
    limits = [f"cpu: {json.dumps(cpu)}"] if cpu is not None else []
    if gpu:
        limits.append("nvidia.com/gpu: 1")
    lines = [
        "apiVersion: apps/v1",
        "kind: Deployment",
        "metadata:",
        f"  name: {WORKLOADS[container]}",
        "spec:",
        "  template:",
        "    spec:",
        "      containers:",
        f"        - name: {container}",
        "          resources:",
    ]
    if cpu is not None:
        lines += ["            requests:", f"              cpu: {json.dumps(cpu)}"]
    lines += ["            limits:", *(f"              {item}" for item in limits)]
    return lines


def write_overlay(
    out_dir: Path,
    *,
    base: str,
    prefill_replicas: int,
    decode_replicas: int,
    prefill_cpu: str | None,
    decode_cpu: str | None,
    gpu: bool,
) -> Path:
    """Write ``out_dir/kustomization.yaml`` over the kustomization directory ``base`` (a path,
    written relative to ``out_dir`` so that the two can move together): the replica counts,
    and CPU requests and limits where given (``"4"``, ``"500m"``); with ``gpu``, one
    ``nvidia.com/gpu`` per pod, stated. Returns the file; ValueError naming a bad value."""
    for name, count in (("prefill", prefill_replicas), ("decode", decode_replicas)):
        if count < 1:
            raise ValueError(f"{name} replicas must be at least 1, got {count}")
    for name, cpu in (("prefill", prefill_cpu), ("decode", decode_cpu)):
        if cpu is not None and not CPU_QUANTITY.match(cpu):
            raise ValueError(f"{name} CPU must be cores ('4', '2.5') or millicores, got {cpu!r}")
    if not (Path(base) / "kustomization.yaml").is_file():
        raise ValueError(f"{base} is no kustomization directory (no kustomization.yaml)")
    out_dir.mkdir(parents=True, exist_ok=True)
    resource = Path(os.path.relpath(Path(base).resolve(), out_dir.resolve())).as_posix()
    lines = [
        "# Written by `splitserve plan search --k8s`: the plan's replicas and resources over",
        f"# {resource}. Apply with `kubectl apply -k {out_dir}`.",
        "apiVersion: kustomize.config.k8s.io/v1beta1",
        "kind: Kustomization",
        "resources:",
        f"  - {json.dumps(resource)}",
        "replicas:",
        f"  - name: {WORKLOADS['prefill']}",
        f"    count: {prefill_replicas}",
        f"  - name: {WORKLOADS['decode']}",
        f"    count: {decode_replicas}",
    ]
    cpus = (("prefill", prefill_cpu), ("decode", decode_cpu))
    patches = [(container, cpu) for container, cpu in cpus if cpu is not None or gpu]
    if patches:
        lines.append("patches:")
        for container, cpu in patches:
            lines.append("  - patch: |-")
            lines += [f"      {line}" for line in _resources_patch(container, cpu, gpu)]
    path = out_dir / "kustomization.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path
