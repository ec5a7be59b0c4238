"""Atomic, checksummed JSON files: written to a temp file in the same directory, fsynced, then
renamed over the target (a reader sees the old file or the new one, never half of one); on read the
checksum is verified so a corrupt or truncated file is refused with a clear error."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from specjax.errors import SpecJaxError


class CorruptFileError(SpecJaxError):
    pass


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Temp file in the target's directory, fsync, rename over the target, fsync the directory:
    a reader or a crash sees the old file or the new one, never part of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would hide the file from other users
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_json_atomic(path: str | Path, payload: dict) -> None:
    body = {"checksum": hashlib.sha256(canonical_json(payload).encode()).hexdigest(), "payload": payload}
    write_bytes_atomic(path, json.dumps(body, indent=1, sort_keys=True).encode("utf-8"))


def read_json_checked(path: str | Path) -> dict:
    path = Path(path)
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        payload, checksum = body["payload"], body["checksum"]
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptFileError(f"{path}: unreadable or truncated ({type(e).__name__})") from None
    if hashlib.sha256(canonical_json(payload).encode()).hexdigest() != checksum:
        raise CorruptFileError(f"{path}: checksum mismatch (the file was modified or damaged)")
    return payload
