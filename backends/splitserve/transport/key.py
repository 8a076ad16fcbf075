"""The handle key: one secret per server start, shared by every instance of that start.

The launcher creates it (``generate_key``) and hands it to tritonserver, whose Python stubs
inherit the environment: either hex in ``SPLITSERVE_HANDLE_KEY`` or a 0600 file named by
``SPLITSERVE_HANDLE_KEY_FILE``. Instances call ``load_key()``; they never invent their own,
which would make every handle of the other role fail its MAC check.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from splitserve.kv.handle import MIN_KEY_SIZE

KEY_ENV = "SPLITSERVE_HANDLE_KEY"
KEY_FILE_ENV = "SPLITSERVE_HANDLE_KEY_FILE"
KEY_SIZE = 32


class HandleKeyError(RuntimeError):
    """The handle key is missing, malformed, or stored where others can read it."""


def generate_key() -> bytes:
    return secrets.token_bytes(KEY_SIZE)


def _checked(key: bytes, source: str) -> bytes:
    if len(key) < MIN_KEY_SIZE:
        raise HandleKeyError(f"handle key from {source} is {len(key)} bytes, need {MIN_KEY_SIZE}")
    return key


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """Read a key file, refusing one that is a symlink or readable by group or others."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise HandleKeyError(f"cannot open handle key file {path}: {exc}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise HandleKeyError(f"handle key file {path} has mode {mode & 0o777:o}, need 0600")
        text = f.read().strip()
    try:
        return _checked(bytes.fromhex(text.decode("ascii")), str(path))
    except (UnicodeDecodeError, ValueError):
        raise HandleKeyError(f"handle key file {path} does not hold hex") from None


def write_key_file(path: str | os.PathLike[str], key: bytes) -> bytes:
    """Create ``path`` (mode 0600) holding ``key`` atomically; if it exists, return its key."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(key.hex() + "\n")
        os.link(tmp, path)
    except FileExistsError:
        return read_key_file(path)
    finally:
        tmp.unlink()
    return key


def load_key(environ: Mapping[str, str] | None = None) -> bytes:
    """The key of this server start, from ``SPLITSERVE_HANDLE_KEY`` or its key file."""
    env = os.environ if environ is None else environ
    if env.get(KEY_ENV):
        try:
            return _checked(bytes.fromhex(env[KEY_ENV]), KEY_ENV)
        except ValueError:
            raise HandleKeyError(f"{KEY_ENV} is not hex") from None
    if env.get(KEY_FILE_ENV):
        return read_key_file(env[KEY_FILE_ENV])
    raise HandleKeyError(
        f"no handle key: the launcher must set {KEY_ENV} (hex) or {KEY_FILE_ENV} (0600 file)"
    )


def load_or_create_key(
    path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> bytes:
    """For launchers: the configured key if any, else the key in ``path`` (created if missing),
    else a fresh key held only in memory."""
    env = os.environ if environ is None else environ
    if env.get(KEY_ENV) or env.get(KEY_FILE_ENV):
        return load_key(env)
    if path is not None:
        return write_key_file(path, generate_key())
    return generate_key()


def key_environ(key: bytes) -> dict[str, str]:
    """Environment entries that hand ``key`` to a child process (tritonserver and its stubs)."""
    return {KEY_ENV: _checked(key, "argument").hex()}
