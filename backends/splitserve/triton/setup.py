"""What every Splitserve model does in ``initialize``: read its config, pin cores, log."""

from __future__ import annotations

import json
import logging
from typing import Any

from splitserve.serving.config import ServingConfig, pin_to_cores
from splitserve.triton.tensors import instance_index, model_parameters


def setup_instance(args: dict[str, Any], role: str) -> ServingConfig:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {args['model_instance_name']} %(name)s: %(message)s",
    )
    params = model_parameters(json.loads(args["model_config"]))
    cfg = ServingConfig.from_parameters({**params, "role": role})
    cores = cfg.cores_for(instance_index(args))
    pin_to_cores(cores, cfg.engine.num_threads)
    logging.getLogger("splitserve").info(
        "%s instance %s: model=%s dtype=%s cores=%s",
        role,
        args["model_instance_name"],
        cfg.engine.model,
        cfg.engine.dtype,
        sorted(cores or []),
    )
    return cfg
