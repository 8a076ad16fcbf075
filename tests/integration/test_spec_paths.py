"""A checkpoint whose path holds quotes, backslashes and spaces: the deployment spec reaches the
stubs as one escaped JSON parameter, and the server serves from it. Repository paths the
Python backend cannot start stubs from are refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from llm_client import http_generate

from splitserve.deploy.launcher import free_ports
from splitserve.deploy.serve import ServeOptions, build_spec, start_server
from splitserve.testing.checkpoints import write_random_checkpoint

pytestmark = [pytest.mark.triton, pytest.mark.slow]

AWKWARD = 'a "quoted" dir\\with back\\slashes, {braces} and $dollars'


def test_serves_from_paths_with_quotes_backslashes_and_spaces(tmp_path: Path) -> None:
    ckpt = write_random_checkpoint(tmp_path / f"ckpt {AWKWARD}", vocab_size=512, tokenizer="bpe")
    http_port, grpc_port, metrics_port = free_ports(3)
    opts = ServeOptions(
        model=str(ckpt),
        layout="both",
        settings={"max_model_len": "256"},
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        host="127.0.0.1",
    )
    server = start_server(build_spec(opts), tmp_path / "repo")
    try:
        texts = {model: http_generate(server.http_url, model) for model in ("llm", "llm_colocated")}
    finally:
        server.stop()
    assert texts["llm"]["text_output"] == texts["llm_colocated"]["text_output"]


@pytest.mark.parametrize(
    "name", ["repo with spaces", 'repo"quoted"', "repo\\slash", "repo$x", "repo-café"]
)
def test_a_repository_path_the_backend_cannot_start_from_is_refused(
    tmp_path: Path, name: str
) -> None:
    with pytest.raises(ValueError, match="ASCII repository path"):
        start_server(build_spec(ServeOptions(model="tiny")), tmp_path / name)
