"""What every Splitserve model does in ``initialize``: read its config, pick its GPU or pin its
cores, log."""

from __future__ import annotations

import json
import logging
from typing import Any

from splitserve.serving.serving_config import CONFIG_PARAMETER, ServingConfig, pin_to_cores
from splitserve.triton.tensors import instance_index, model_parameters


def setup_instance(args: dict[str, Any], role: str) -> ServingConfig:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {args['model_instance_name']} %(name)s: %(message)s",
    )
    params = model_parameters(json.loads(args["model_config"]))
    cfg = ServingConfig.from_json(params[CONFIG_PARAMETER])
    if cfg.role != role:
        raise ValueError(f"{CONFIG_PARAMETER} is for the {cfg.role} role, not {role}")
    log = logging.getLogger("splitserve")
    name = args["model_instance_name"]
    if cfg.engine.device.startswith("cuda"):
        import torch  # the stub imports torch anyway; here it only has to pick the device

        # Before anything is placed on "cuda": the pool, the model and the IPC exports all use
        # the current device, which must be the one Triton gave this instance.
        gpu = int(args["model_instance_device_id"])
        torch.cuda.set_device(gpu)
        log.info(
            "%s instance %s: model=%s dtype=%s gpu=%d",
            role,
            name,
            cfg.engine.model,
            cfg.engine.dtype,
            gpu,
        )
        return cfg
    cores = cfg.cores_for(instance_index(args))
    pin_to_cores(cores, cfg.engine.num_threads)
    log.info(
        "%s instance %s: model=%s dtype=%s cores=%s",
        role,
        name,
        cfg.engine.model,
        cfg.engine.dtype,
        sorted(cores or []),
    )
    return cfg
