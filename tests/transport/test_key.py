import os
import stat

import pytest

from splitserve.transport.key import (
    KEY_ENV,
    KEY_FILE_ENV,
    HandleKeyError,
    generate_key,
    key_environ,
    load_key,
    load_or_create_key,
    write_key_file,
)


def test_env_hex_round_trip():
    key = generate_key()
    assert len(key) == 32
    assert load_key(key_environ(key)) == key


def test_missing_short_and_non_hex_env():
    with pytest.raises(HandleKeyError, match=KEY_ENV):
        load_key({})
    with pytest.raises(HandleKeyError, match="bytes"):
        load_key({KEY_ENV: "abcd"})
    with pytest.raises(HandleKeyError, match="hex"):
        load_key({KEY_ENV: "zz" * 32})


def test_key_file_is_created_0600_once(tmp_path):
    path = tmp_path / "handle.key"
    first = load_or_create_key(path, environ={})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_key(path, environ={}) == first
    assert write_key_file(path, generate_key()) == first
    assert load_key({KEY_FILE_ENV: str(path)}) == first
    assert [p.name for p in tmp_path.iterdir()] == ["handle.key"]


def test_key_file_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "handle.key"
    write_key_file(path, generate_key())
    os.chmod(path, 0o644)
    with pytest.raises(HandleKeyError, match="0600"):
        load_key({KEY_FILE_ENV: str(path)})


def test_env_wins_and_no_config_gives_a_fresh_key(tmp_path):
    key = generate_key()
    assert load_or_create_key(tmp_path / "k", environ=key_environ(key)) == key
    assert not (tmp_path / "k").exists()
    assert load_or_create_key(environ={}) != load_or_create_key(environ={})
