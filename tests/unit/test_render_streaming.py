"""Layer-wise KV streaming in the rendered repository: a prefill server's ``prefill`` is
decoupled by default over nixl, not with ``--no-kv-stream-layers``, and never within one
server (BLS takes the handle after the pass)."""

from pathlib import Path

import pytest
from rendered_config import rendered

from splitserve.deploy.render import render
from splitserve.deploy.serve import ServeOptions, build_spec
from splitserve.serving.serving_config import ServingConfig


def prefill(tmp_path: Path, **fields: object) -> tuple[str, ServingConfig]:
    key = tmp_path / "handle.key"
    key.write_text("ab" * 32)
    opts = ServeOptions(model="tiny", server_role="prefill", key_file=str(key), **fields)
    repo = render(build_spec(opts), tmp_path / "repo")
    return (repo / "prefill" / "config.pbtxt").read_text(), rendered(repo, "prefill")


def test_a_prefill_server_streams_by_default(tmp_path: Path) -> None:
    text, cfg = prefill(tmp_path)
    assert "model_transaction_policy { decoupled: true }" in text
    assert cfg.kv_stream_layers and cfg.transport == "nixl"


def test_no_kv_stream_layers_renders_a_plain_prefill(tmp_path: Path) -> None:
    text, cfg = prefill(tmp_path, kv_stream_layers=False)
    assert "model_transaction_policy { decoupled: false }" in text
    assert not cfg.kv_stream_layers


def test_streaming_is_refused_where_bls_calls_prefill(tmp_path: Path) -> None:
    opts = ServeOptions(model="tiny", kv_stream_layers=True)
    with pytest.raises(ValueError, match="kv_stream_layers applies to prefill servers"):
        build_spec(opts)
    with pytest.raises(ValueError, match="needs transport nixl"):
        prefill(tmp_path, transport="shm", kv_stream_layers=True)
