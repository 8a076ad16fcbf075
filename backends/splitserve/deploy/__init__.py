"""Start and stop tritonserver processes (NGC container or the nvidia-pytriton wheel)."""

from splitserve.deploy.launcher import (
    TritonInstall,
    TritonServer,
    find_tritonserver,
    free_port,
    prepare_backend_dir,
    server_env,
)

__all__ = [
    "TritonInstall",
    "TritonServer",
    "find_tritonserver",
    "free_port",
    "prepare_backend_dir",
    "server_env",
]
