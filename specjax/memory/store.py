"""The search loop's memory: one JSON file per validated mechanism set.

A record is written only after the set passed the token-forcing gate (zero failures, every position
checked), so everything here is known to be lossless on the deployment it names. Layout:

    root/records/<record_id>.json   {"checksum": ..., "record": {...}, "schema_version": 1}

(root/records itself is the flock target: puts share it, prune takes it alone; no extra lock file.)

Nothing may be lost or silently altered:
- a file is written to a unique temp name in the same directory, fsynced, then `os.replace`d, so a
  reader sees the old state or the new one, never half a file, and parallel writers never collide;
- a read re-checks the schema, the sha256 of the content, the id (derived from that checksum) against
  the file name, and that the file is byte-identical to the canonical serialization of what it holds,
  so any changed byte, whitespace included, is refused with the file named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import fcntl
import hashlib
import json
import math
import os
import re
import sys
import uuid
from pathlib import Path

from specjax.errors import ConfigError, SpecJaxError

SCHEMA_VERSION = 1


class MemoryRecordError(SpecJaxError):
    """A record (or record file) is invalid, corrupt or missing; the message names the file and field."""


class RecordNotFound(MemoryRecordError, KeyError):
    """No record with that id. Also a KeyError, so `except KeyError` works; printed without its quotes."""

    __str__ = Exception.__str__


# Sub-dicts with a fixed set of fields: name -> type ("float" accepts ints and stores floats, so 2 and
# 2.0 give the same checksum; "int" refuses bools, which Python counts as ints).
_FIXED = {
    "measured": {"tokens_per_s": "float", "speedup": "float", "runs": "int", "device": "str"},
    "predicted": {"tokens_per_s": "float", "speedup": "float"},
    "forcing": {"checked": "int", "expected": "int", "failures": "int", "near_ties": "int",
                "tolerance": "float"},
}
# The deployment fingerprint needs these; other scalar fields may be added (they count in similar()).
_DEPLOYMENT = {"target": "str", "hardware": "str", "batch": "int", "prompts": "str",
               "max_new_tokens": "int", "sampling": "str", "weight_format": "str"}
_ENVELOPE = {"schema_version", "checksum", "record"}
_ID = re.compile(r"[0-9a-f]{16}")
_CHECKSUM = re.compile(r"[0-9a-f]{64}")
# similar(): target and hardware decide most of what a mechanism gains (draft/target cost ratio,
# memory bandwidth), so an equal one outweighs any two other equal fields.
_WEIGHTS = {"target": 3, "hardware": 3}


def utc_now() -> str:
    """The current time as the ISO 8601 UTC string `created` expects."""
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _canonical(obj) -> str:
    # sort_keys + fixed separators: the same content always gives the same bytes, hence the same id.
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _file_text(envelope: dict) -> str:
    # What is on disk: indented for people, but still one deterministic form, checked on read.
    return json.dumps(envelope, sort_keys=True, indent=2, ensure_ascii=True, allow_nan=False) + "\n"


def _checksum(content: dict) -> str:
    return hashlib.sha256(_canonical(content).encode("ascii")).hexdigest()


def _parse_created(value: str, where: str) -> dt.datetime:
    try:
        t = dt.datetime.fromisoformat(value)
    except ValueError:
        raise MemoryRecordError(f"{where}: field 'created': not an ISO 8601 time: {value!r}") from None
    if t.utcoffset() != dt.timedelta(0):
        raise MemoryRecordError(f"{where}: field 'created': must be UTC (e.g. 2025-01-31T12:00:00Z), "
                                f"got {value!r}")
    return t


def _check(value, kind: str, where: str, field: str):
    """Return the value (floats normalized) or raise naming the field."""
    def bad(expected):
        raise MemoryRecordError(f"{where}: field '{field}': expected {expected}, "
                                f"got {type(value).__name__} {value!r}")
    if kind == "str":
        if not isinstance(value, str):
            bad("a string")
        return value
    if kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            bad("an integer")
        return value
    if kind == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            bad("a number")
        if not math.isfinite(value):
            bad("a finite number")
        return float(value)
    if kind in ("scalar", "scalar_or_null"):
        if value is None and kind == "scalar_or_null":
            return value
        if not isinstance(value, (str, int, float, bool)):
            bad("a string, number or boolean" + (" or null" if kind == "scalar_or_null" else ""))
        if isinstance(value, float) and not math.isfinite(value):
            bad("a finite number")
        return value
    raise AssertionError(kind)


def _check_dict(d, where: str, field: str, required: dict, extra: str | None) -> dict:
    """Check a sub-dict: the `required` fields with their types; other keys only if `extra` names
    the type they must have."""
    if not isinstance(d, dict):
        raise MemoryRecordError(f"{where}: field '{field}': expected an object, got {type(d).__name__}")
    out = {}
    for name, kind in required.items():
        if name not in d:
            raise MemoryRecordError(f"{where}: field '{field}.{name}' is missing")
        out[name] = _check(d[name], kind, where, f"{field}.{name}")
    for name in sorted(set(d) - set(required), key=str):
        if extra is None:
            raise MemoryRecordError(f"{where}: field '{field}.{name}': unknown field "
                                    f"(expected {', '.join(required)})")
        if not isinstance(name, str) or not name:
            raise MemoryRecordError(f"{where}: field '{field}': keys must be non-empty strings")
        out[name] = _check(d[name], extra, where, f"{field}.{name}")
    return out


@dataclasses.dataclass
class MemoryRecord:
    spec_name: str
    deployment: dict  # fingerprint: the _DEPLOYMENT fields (target, hardware, ...) plus any scalars
    config: dict  # the full mechanism config, flat {"drafter.kind": "ngram", "drafter.k": 4, ...}
    config_delta: dict  # only what differs from the stock/baseline config
    measured: dict  # tokens_per_s, speedup, runs, device
    predicted: dict  # tokens_per_s, speedup
    forcing: dict  # checked, expected, failures, near_ties, tolerance
    git_commit: str
    device: str
    created: str  # ISO 8601 UTC
    record_id: str = ""  # filled by put(): first 16 hex chars of the content checksum

    def to_json_dict(self) -> dict:
        return dataclasses.asdict(self)

    def content(self) -> dict:
        """What the checksum and id cover: every field but the id itself."""
        d = self.to_json_dict()
        del d["record_id"]
        return d

    @classmethod
    def from_json_dict(cls, d, where: str) -> "MemoryRecord":
        """Validate every field's presence and type (errors name `where` and the field) and return a
        record that shares no dicts with `d`."""
        if not isinstance(d, dict):
            raise MemoryRecordError(f"{where}: a record must be a JSON object, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        for name in names:
            if name not in d and name != "record_id":
                raise MemoryRecordError(f"{where}: field '{name}' is missing")
        unknown = sorted(set(d) - set(names), key=str)
        if unknown:
            raise MemoryRecordError(f"{where}: field '{unknown[0]}': unknown field")
        v = {}
        for name in ("spec_name", "git_commit", "device", "created", "record_id"):
            v[name] = _check(d.get(name, ""), "str", where, name)
        for name in ("spec_name", "device", "created"):
            if not v[name].strip():
                raise MemoryRecordError(f"{where}: field '{name}' is empty")
        _parse_created(v["created"], where)
        v["deployment"] = _check_dict(d["deployment"], where, "deployment", _DEPLOYMENT, "scalar")
        for name in ("config", "config_delta"):
            v[name] = _check_dict(d[name], where, name, {}, "scalar_or_null")
        for name, fields in _FIXED.items():
            v[name] = _check_dict(d[name], where, name, fields, None)
        f, m = v["forcing"], v["measured"]
        # "Validated" is part of the schema: the memory only holds sets that passed the forcing gate.
        if f["failures"] != 0:
            raise MemoryRecordError(f"{where}: field 'forcing.failures': {f['failures']} token-forcing "
                                    "failures; only mechanism sets that passed the gate are stored")
        if f["expected"] <= 0 or f["checked"] != f["expected"]:
            raise MemoryRecordError(f"{where}: field 'forcing.checked': {f['checked']} of {f['expected']} "
                                    "positions checked; the gate needs every position (and at least one)")
        if m["runs"] < 1 or m["tokens_per_s"] <= 0 or m["speedup"] <= 0:
            raise MemoryRecordError(f"{where}: field 'measured': runs must be >= 1 and tokens_per_s, "
                                    f"speedup > 0, got {m}")
        return cls(**v)


def _fsync_dir(path: Path) -> None:
    # The rename itself must reach the disk too, or a power cut could forget the new name.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MemoryStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.dir = self.root / "records"

    def __repr__(self):
        return f"MemoryStore({str(self.root)!r})"

    @contextlib.contextmanager
    def _lock(self, exclusive: bool):
        # Puts share the lock (they never conflict: unique temp names, idempotent content); prune takes
        # it alone, so it never deletes a record a concurrent put just reported as present, and any
        # temp file it sees then is a leftover of a crashed write, not one in flight.
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir, os.O_RDONLY)  # flock works on a directory's descriptor too
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock

    def path(self, record_id: str) -> Path:
        if not isinstance(record_id, str) or not _ID.fullmatch(record_id):
            raise MemoryRecordError(f"{record_id!r}: not a record id (16 lowercase hex characters)")
        return self.dir / f"{record_id}.json"

    def put(self, record: MemoryRecord) -> MemoryRecord:
        """Validate, compute the id, write atomically; return the stored record (with its id).
        Identical content gives the same id, so putting it again changes nothing."""
        rec = MemoryRecord.from_json_dict(record.to_json_dict(), "record to put")
        checksum = _checksum(rec.content())
        rec = dataclasses.replace(rec, record_id=checksum[:16])
        text = _file_text({"schema_version": SCHEMA_VERSION, "checksum": checksum,
                           "record": rec.to_json_dict()})
        target = self.path(rec.record_id)
        with self._lock(exclusive=False):
            with contextlib.suppress(MemoryRecordError):
                if self._read(target) == rec:
                    return rec  # already stored; a corrupt file of that id is rewritten below
            # Unique per process and call, so parallel writers of the same id never share a temp file.
            tmp = self.dir / f".{rec.record_id}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
            try:
                with open(tmp, "x", encoding="ascii") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()  # only still there if the write or the rename failed
            _fsync_dir(self.dir)
        return rec

    def get(self, record_id: str) -> MemoryRecord:
        path = self.path(record_id)
        if not path.exists():
            raise RecordNotFound(f"{path}: no record {record_id} in the memory store {self.root}")
        return self._read(path)

    def _read(self, path: Path) -> MemoryRecord:
        """Read and fully verify one record file; any problem raises MemoryRecordError naming it."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise RecordNotFound(f"{path}: record file not found") from None
        except OSError as e:
            raise MemoryRecordError(f"{path}: unreadable: {e.strerror}") from None
        try:
            env = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise MemoryRecordError(f"{path}: not UTF-8 text (byte {e.start}); the file is corrupt") from None
        except json.JSONDecodeError as e:
            raise MemoryRecordError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                                    "the file is corrupt or truncated") from None
        if not isinstance(env, dict):
            raise MemoryRecordError(f"{path}: expected a JSON object with {sorted(_ENVELOPE)}")
        for name in sorted(_ENVELOPE):
            if name not in env:
                raise MemoryRecordError(f"{path}: field '{name}' is missing")
        if set(env) != _ENVELOPE:
            raise MemoryRecordError(f"{path}: field '{sorted(set(env) - _ENVELOPE)[0]}': unknown field")
        version = env["schema_version"]
        if type(version) is not int or version != SCHEMA_VERSION:
            raise MemoryRecordError(f"{path}: field 'schema_version': {version!r} is not supported "
                                    f"(this specjax reads version {SCHEMA_VERSION})")
        checksum = env["checksum"]
        if not isinstance(checksum, str) or not _CHECKSUM.fullmatch(checksum):
            raise MemoryRecordError(f"{path}: field 'checksum': expected 64 lowercase hex characters")
        body = env["record"]
        if not isinstance(body, dict):
            raise MemoryRecordError(f"{path}: field 'record': expected an object")
        # Checksum before schema: a changed byte is reported as corruption, not as a confusing type error.
        try:
            actual = _checksum({k: v for k, v in body.items() if k != "record_id"})
        except ValueError:  # json.loads accepts NaN/Infinity, which we never write
            raise MemoryRecordError(f"{path}: field 'record': contains NaN or Infinity; "
                                    "the file is corrupt") from None
        if actual != checksum:
            raise MemoryRecordError(f"{path}: checksum mismatch: the content changed after it was written "
                                    "(corrupt or edited file)")
        rec = MemoryRecord.from_json_dict(body, str(path))
        if rec.record_id != checksum[:16] or path.stem != rec.record_id:
            raise MemoryRecordError(f"{path}: field 'record_id': {rec.record_id!r} does not match the "
                                    f"checksum ({checksum[:16]}) and the file name")
        if raw != _file_text(env).encode("ascii"):
            raise MemoryRecordError(f"{path}: the file differs from the canonical form of its content "
                                    "(edited or corrupted bytes)")
        return rec

    def records(self) -> tuple[list[MemoryRecord], list[tuple[Path, str]]]:
        """(valid records oldest first, [(path, reason)] for each corrupt file). Never raises on a bad
        file: the store stays usable and the bad file is reported for `prune --remove-corrupt`."""
        good, bad = [], []
        if not self.dir.is_dir():
            return good, bad
        for path in sorted(self.dir.glob("*.json")):  # temp files end in .tmp and are not records
            try:
                good.append(self._read(path))
            except MemoryRecordError as e:
                bad.append((path, str(e).removeprefix(f"{path}: ")))
        good.sort(key=lambda r: (_parse_created(r.created, r.record_id), r.record_id))
        return good, bad

    def similar(self, deployment: dict, limit: int = 5) -> list[MemoryRecord]:
        """Records of the most similar deployments first: score = equal fingerprint fields (target and
        hardware count 3, others 1), ties by measured speedup, then newest. Only score > 0."""
        scored = []
        for rec in self.records()[0]:
            score = sum(_WEIGHTS.get(k, 1) for k, v in deployment.items()
                        if k in rec.deployment and _same(rec.deployment[k], v))
            if score > 0:
                scored.append((score, rec))
        scored.sort(key=lambda sr: (-sr[0], *_best_first(sr[1])))
        return [rec for _, rec in scored[:limit]]

    def matching(self, deployment: dict) -> list[MemoryRecord]:
        """Valid records whose deployment has every given field with the same value, best measured
        speedup first (what a bench's searched method runs)."""
        found = [rec for rec in self.records()[0]
                 if all(k in rec.deployment and _same(rec.deployment[k], v) for k, v in deployment.items())]
        return sorted(found, key=_best_first)

    def prune(self, *, keep_best_per_deployment: int | None = None, older_than_days: float | None = None,
              remove_corrupt: bool = False, dry_run: bool = False) -> list[Path]:
        """Remove (or with dry_run only list) every file any given criterion selects; return the paths.
        keep_best_per_deployment=N keeps the N highest measured speedups of each distinct deployment;
        older_than_days=D removes records created more than D days ago; remove_corrupt removes files
        that fail verification and temp files left by interrupted writes."""
        if keep_best_per_deployment is not None and keep_best_per_deployment < 1:
            raise ConfigError(f"--keep-best must be at least 1, got {keep_best_per_deployment}")
        if older_than_days is not None and not older_than_days >= 0:
            raise ConfigError(f"--older-than-days must be >= 0, got {older_than_days}")
        if not self.dir.is_dir():
            return []
        with self._lock(exclusive=True):
            good, bad = self.records()
            remove = set()
            if keep_best_per_deployment is not None:
                groups: dict[str, list[MemoryRecord]] = {}
                for rec in good:
                    groups.setdefault(_canonical(rec.deployment), []).append(rec)
                for recs in groups.values():
                    recs.sort(key=_best_first)
                    remove.update(self.path(r.record_id) for r in recs[keep_best_per_deployment:])
            if older_than_days is not None:
                cutoff = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=older_than_days)
                remove.update(self.path(r.record_id) for r in good
                              if _parse_created(r.created, r.record_id) < cutoff)
            if remove_corrupt:
                remove.update(p for p, _ in bad)
                remove.update(self.dir.glob(".*.tmp"))  # no put is in flight: we hold the lock alone
            removed = sorted(remove)
            if not dry_run:
                for p in removed:
                    p.unlink(missing_ok=True)  # a hand-deleted file is no error
                if removed:
                    _fsync_dir(self.dir)
        return removed


def _best_first(rec: MemoryRecord) -> tuple:
    # Highest measured speedup first; on a tie the newer record (measured on newer code) first.
    return (-rec.measured["speedup"], -_parse_created(rec.created, rec.record_id).timestamp(), rec.record_id)


def _same(a, b) -> bool:
    # 1 == True in Python; a boolean field never matches a number.
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def seed_configs(store: MemoryStore, deployment: dict, limit: int = 5) -> list[dict]:
    """First-round configs for a new search: the full configs of the most similar deployments' records,
    best first, without duplicates (the same set often wins on several deployments)."""
    seen, out = set(), []
    for rec in store.similar(deployment, limit=sys.maxsize):
        key = _canonical(rec.config)
        if key not in seen:
            seen.add(key)
            out.append(dict(rec.config))
        if len(out) == limit:
            break
    return out
