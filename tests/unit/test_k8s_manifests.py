"""deploy/k8s: the base and each overlay render (``kubectl kustomize``), validate offline against
the Kubernetes schemas, and hold what multi-node Splitserve needs; every container's arguments
parse with the real ``splitserve serve`` parser into a valid deployment spec; the planner's
overlay (``write_overlay``) renders with its replicas and resources."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import math
import re
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from splitserve.cli import add_runtime_parsers, serve_options
from splitserve.deploy.serve import build_spec, check_paths
from splitserve_tools.k8s_overlay import overlay_dir, write_overlay

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
TREES = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu"}
DEVICE = {"base": "cpu", "cpu": "cpu", "gpu": "gpu"}
"""The device each tree's servers run on (the base names none: `serve`'s default, cpu)."""
ROLES = {"splitserve-prefill": "prefill", "splitserve-decode": "decode"}
KEY_PATH = "/etc/splitserve/key/handle.key"
MODEL_PATH = "/models/model"
POD_IP = "10.1.2.3"
KUBECTL = shutil.which("kubectl")

needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed (`kubectl kustomize` renders deploy/k8s)"
)


@functools.cache
def render(tree: Path) -> tuple[dict[str, Any], ...]:
    assert KUBECTL is not None
    done = subprocess.run(
        [KUBECTL, "kustomize", str(tree)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"kubectl kustomize {tree} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def find(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_spec(docs: tuple[dict[str, Any], ...], deployment: str) -> dict[str, Any]:
    return find(docs, "Deployment", deployment)["spec"]["template"]["spec"]


def container(docs: tuple[dict[str, Any], ...], deployment: str) -> dict[str, Any]:
    (only,) = pod_spec(docs, deployment)["containers"]
    return only


def cpu_cores(quantity: str) -> int:
    """A CPU quantity in whole cores, rounded up: what the downward API's ``resourceFieldRef``
    with divisor 1 gives."""
    if quantity.endswith("m"):
        return math.ceil(int(quantity[:-1]) / 1000)
    return math.ceil(float(quantity))


def expand(args: list[str], box: dict[str, Any]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of ``args`` from the container's env, with the values
    the kubelet would give: the pod's IP, the CPU limit in whole cores."""
    values = {}
    for env in box.get("env", []):
        source = env.get("valueFrom", {})
        if source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            values[env["name"]] = POD_IP
        elif source.get("resourceFieldRef", {}).get("resource") == "limits.cpu":
            assert source["resourceFieldRef"].get("divisor") == "1", env
            values[env["name"]] = str(cpu_cores(box["resources"]["limits"]["cpu"]))
        elif "value" in env:
            values[env["name"]] = env["value"]

    def one(match: re.Match[str]) -> str:
        assert match[1] in values, f"$({match[1]}) names no env var of the container"
        return values[match[1]]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg) for arg in args]


def parse_serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="splitserve")
    add_runtime_parsers(parser.add_subparsers(dest="cmd"))
    errors = io.StringIO()
    # argparse exits on an unknown flag or a bad value: fail naming the command and its error.
    with contextlib.suppress(SystemExit), contextlib.redirect_stderr(errors):
        return parser.parse_args(argv)
    pytest.fail(f"`splitserve {' '.join(argv)}` does not parse:\n{errors.getvalue()}")


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_renders_and_validates_against_the_schemas(tree: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    version = kv.latest_version()
    docs = render(TREES[tree])
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == [
        ("Deployment", "splitserve-decode"),
        ("Deployment", "splitserve-prefill"),
        ("Service", "splitserve"),
        ("Service", "splitserve-prefill"),
    ]
    for doc in docs:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{tree}: {doc['kind']}/{doc['metadata']['name']}: {where}: {exc.message}")


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_services_prefill_headless_decode_faces_clients(tree: str) -> None:
    docs = render(TREES[tree])
    labels = {
        name: find(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        for name in ROLES
    }

    def selects(service: dict[str, Any]) -> list[str]:
        wanted = service["spec"]["selector"].items()
        return [name for name, have in labels.items() if wanted <= have.items()]

    prefill = find(docs, "Service", "splitserve-prefill")
    assert prefill["spec"]["clusterIP"] == "None"
    assert prefill["spec"]["publishNotReadyAddresses"] is False
    assert selects(prefill) == ["splitserve-prefill"]
    assert [(p["port"], p["targetPort"]) for p in prefill["spec"]["ports"]] == [(8001, "grpc")]

    client = find(docs, "Service", "splitserve")
    assert client["spec"].get("clusterIP") != "None"
    assert selects(client) == ["splitserve-decode"]
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in client["spec"]["ports"]}
    assert ports == {
        "http": (8000, "http"),
        "grpc": (8001, "grpc"),
        "metrics": (8002, "metrics"),
        "openai": (9000, "openai"),
    }
    # Every named target port is a port of the pods it selects.
    for service, deployment in ((prefill, "splitserve-prefill"), (client, "splitserve-decode")):
        named = {p["name"]: p["containerPort"] for p in container(docs, deployment)["ports"]}
        for port in service["spec"]["ports"]:
            assert named[port["targetPort"]] == port["port"], (service["metadata"], port)


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_pods_key_probes_drain_metrics(tree: str) -> None:
    docs = render(TREES[tree])
    for deployment in ROLES:
        spec = pod_spec(docs, deployment)
        box = container(docs, deployment)
        assert box["command"] == ["splitserve"] and box["args"][0] == "serve"
        assert box["image"] == "splitserve:latest"

        # The key: the existing Secret, owner-read only, mounted read-only as a plain file.
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in box["volumeMounts"]}
        key = mounts[KEY_PATH]
        assert key["readOnly"] is True and key["subPath"] == "handle.key"
        secret = volumes[key["name"]]["secret"]
        assert secret["secretName"] == "splitserve-key"
        assert secret["defaultMode"] == 0o400
        assert "fsGroup" not in spec.get("securityContext", {}), "fsGroup makes the key g+r"
        assert mounts[MODEL_PATH]["readOnly"] is True
        assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"

        http = {p["name"]: p["containerPort"] for p in box["ports"]}["http"]
        assert http == 8000
        for probe, path in (
            ("readinessProbe", "/v2/health/ready"),
            ("livenessProbe", "/v2/health/live"),
        ):
            assert box[probe]["httpGet"] == {"path": path, "port": "http"}, probe
        assert box["lifecycle"]["preStop"]["exec"]["command"] == ["sh", "-c", "sleep 5"]
        assert spec["terminationGracePeriodSeconds"] == 60

        annotations = find(docs, "Deployment", deployment)["spec"]["template"]["metadata"]
        assert {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": "8002",
            "prometheus.io/path": "/metrics",
        }.items() <= annotations["annotations"].items()

        pod_ip = {e["name"]: e.get("valueFrom", {}) for e in box["env"]}["POD_IP"]
        assert pod_ip == {"fieldRef": {"fieldPath": "status.podIP"}}
        for side in ("requests", "limits"):
            assert {"cpu", "memory"} <= box["resources"][side].keys(), (deployment, side)

        gpus = box["resources"]["limits"].get("nvidia.com/gpu")
        tolerated = [t.get("key") for t in spec.get("tolerations", [])]
        if tree == "gpu":
            assert str(gpus) == "1" and "nvidia.com/gpu" in tolerated
        else:
            assert gpus is None and not tolerated
        if tree == "cpu":
            assert box["resources"]["requests"]["cpu"] == "4"


def check_args(box: dict[str, Any], role: str, device: str, tmp_path: Path) -> Any:
    """Parses the container's args with the real ``serve`` parser and builds its spec; returns
    the spec. Two substitutions make them runnable here, each checked to apply: the key path
    (a Secret mounted in the pod) becomes a real 0600 key file, since checking the spec reads
    it; the model path (an empty placeholder volume) becomes ``tiny``, the built-in random
    weights, so no checkpoint is needed."""
    args = expand(box["args"], box)
    assert args.count(KEY_PATH) == 1 and args.count(MODEL_PATH) == 1, args
    key = tmp_path / "handle.key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    args = [str(key) if a == KEY_PATH else "tiny" if a == MODEL_PATH else a for a in args]

    parsed = parse_serve(args)
    assert parsed.cmd == "serve" and parsed.role == role
    # The ports the pod declares are the server's.
    ports = {p["name"]: p["containerPort"] for p in box["ports"]}
    assert (parsed.http_port, parsed.grpc_port, parsed.metrics_port) == (
        ports["http"],
        ports["grpc"],
        ports["metrics"],
    )
    assert parsed.openai_port == ports.get("openai")
    spec = build_spec(serve_options(parsed))
    check_paths(spec, tmp_path / "repo")  # reads and checks the key file
    assert (spec.server_role, spec.device, spec.key_file) == (role, device, str(key))
    assert spec.settings["transport"] == "nixl"
    assert spec.settings["advertise_host"] == POD_IP
    return spec


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("deployment", ROLES)
def test_container_args_parse_into_a_spec(tree: str, deployment: str, tmp_path: Path) -> None:
    docs = render(TREES[tree])
    box = container(docs, deployment)
    role = ROLES[deployment]
    spec = check_args(box, role, DEVICE[tree], tmp_path)
    if role == "decode":
        # Decode finds prefill pods through the headless Service, on its gRPC port.
        prefill = find(docs, "Service", "splitserve-prefill")
        (port,) = prefill["spec"]["ports"]
        name = prefill["metadata"]["name"]
        assert spec.decode.settings["prefill_dns"] == f"{name}:{port['port']}"
    if tree == "cpu":
        assert spec.settings["num_threads"] == cpu_cores(box["resources"]["limits"]["cpu"])
    if tree == "gpu":
        assert spec.role(role).gpus == (0,)


@needs_kubectl
@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_write_overlay_renders_the_plan(gpu: bool, tmp_path: Path) -> None:
    out = tmp_path / "plan" / "k8s"
    written = write_overlay(
        out,
        base=str(overlay_dir(REPO, gpu)),
        prefill_replicas=3,
        decode_replicas=2,
        prefill_cpu="8",
        decode_cpu="1500m",
        gpu=gpu,
    )
    assert written == out / "kustomization.yaml"
    (resource,) = yaml.safe_load(written.read_text())["resources"]
    assert not Path(resource).is_absolute()

    docs = render(out)
    over = render(overlay_dir(REPO, gpu))
    for deployment, replicas, cpu in (
        ("splitserve-prefill", 3, "8"),
        ("splitserve-decode", 2, "1500m"),
    ):
        assert find(docs, "Deployment", deployment)["spec"]["replicas"] == replicas
        box = container(docs, deployment)
        assert box["resources"]["requests"]["cpu"] == cpu
        assert box["resources"]["limits"]["cpu"] == cpu
        assert str(box["resources"]["limits"].get("nvidia.com/gpu")) == ("1" if gpu else "None")
        # Only replicas and resources change; memory and arguments are the overlay's.
        before = container(over, deployment)
        assert box["args"] == before["args"]
        assert box["resources"]["limits"]["memory"] == before["resources"]["limits"]["memory"]
        spec = check_args(box, ROLES[deployment], "gpu" if gpu else "cpu", tmp_path)
        if not gpu:  # torch threads follow the new CPU limit
            assert spec.settings["num_threads"] == cpu_cores(cpu)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"prefill_replicas": 0}, "prefill replicas"),
        ({"decode_cpu": "four"}, "decode CPU"),
        ({"base": str(K8S)}, "no kustomization"),
    ],
)
def test_write_overlay_refuses(change: dict[str, Any], error: str, tmp_path: Path) -> None:
    given: dict[str, Any] = {
        "base": str(overlay_dir(REPO, False)),
        "prefill_replicas": 1,
        "decode_replicas": 1,
        "prefill_cpu": None,
        "decode_cpu": None,
        "gpu": False,
        **change,
    }
    with pytest.raises(ValueError, match=error):
        write_overlay(tmp_path, **given)
