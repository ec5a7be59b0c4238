"""Packed model files (`.w12`): LH12 planes in a safetensors blob behind a checksummed JSON header.

    magic     8 bytes   b"SPJXW12\\n"
    length    8 bytes   n, the header's byte length (little-endian; padded so the blob is 8-aligned)
    sha256   32 bytes   of the n header bytes
    header    n bytes   canonical JSON: format_version, config, tokenizer, planes, tensors
    blob                a safetensors file of planes "<tensor>/<plane>": LH12 words or raw bf16 bits

Every byte is under a check that runs before anything is decoded: the magic is compared, the
header has its sha256, the blob's own index (safetensors header) has `planes.index_sha256`, and
each tensor's sha256 covers its header entry and its planes. So a damaged file is refused with a
ModelFormatError naming the file (and the tensor), never loaded as silently wrong weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy

from specjax.atomic import canonical_json, write_bytes_atomic
from specjax.errors import ConfigError, ModelFormatError, SpecJaxError
from specjax.models.config import ModelConfig, RopeScaling
from specjax.models.loading import LoadedModel, load_model
from specjax.models.params import ModelParams, init_random_params
from specjax.tokenizer import Tokenizer
from specjax.weights.lh12 import (PLANES, WORD, FormatChoice, Packed12, choose_format, decode, encode,
                                  plane_shapes)

MAGIC = b"SPJXW12\n"
SUFFIX = ".w12"
FORMAT_VERSION = 2  # 2: super-words hold column stripes (lh12.py), so kernels get contiguous blocks
_PREFIX = len(MAGIC) + 8 + 32


# --------------------------------------------------------------------------- writing

def pack_model(model_source: str | os.PathLike | LoadedModel, out_path: str | os.PathLike
               ) -> dict[str, FormatChoice]:
    """Pack a model (anything `load_model` takes, loaded in bf16, or a LoadedModel, cast to bf16)
    into `out_path`, atomically. Returns each tensor's format choice."""
    out = Path(out_path)
    if out.suffix != SUFFIX:
        raise ConfigError(f"{out}: a packed model's file name must end in {SUFFIX} (load_model "
                          "recognizes it by that)")
    model = model_source if isinstance(model_source, LoadedModel) else load_model(
        os.fspath(model_source), dtype="bfloat16")
    data, choices = packed_bytes(model)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(out, data)
    except OSError as e:
        raise SpecJaxError(f"{out}: cannot write: {e.strerror or e}") from None
    return choices


def packed_bytes(model: LoadedModel) -> tuple[bytes, dict[str, FormatChoice]]:
    """The `.w12` file of a model, in memory, and each tensor's format choice."""
    arrays, entries, choices = {}, {}, {}
    for name, x in _named_leaves(model.params):
        bits = np.asarray(jnp.asarray(x, jnp.bfloat16)).view(np.uint16)
        choice = choose_format(bits)
        entry = {"format": choice.format, "shape": list(bits.shape),
                 "bits_per_weight": choice.bits_per_weight, "reason": choice.reason}
        if choice.format == "lh12":
            p = encode(bits)
            entry.update(base=p.base, n_escape=p.n_escape)
            planes = {k: getattr(p, k) for k in PLANES}
        else:
            planes = {"bf16": bits}
        entry["sha256"] = _tensor_digest(name, entry, list(planes.values()))
        entries[name], choices[name] = entry, choice
        arrays.update({f"{name}/{k}": v for k, v in planes.items()})
    blob = safetensors.numpy.save(arrays)
    header = {"format_version": FORMAT_VERSION,
              "config": dataclasses.asdict(model.cfg.with_dtype("bfloat16")),
              "tokenizer": _tokenizer_to_json(model.tokenizer),
              "planes": {"bytes": len(blob), "index_sha256": _index_digest(blob)},
              "tensors": entries}
    raw = canonical_json(header).encode()
    raw += b" " * (-len(raw) % 8)
    return MAGIC + len(raw).to_bytes(8, "little") + hashlib.sha256(raw).digest() + raw + blob, choices


# --------------------------------------------------------------------------- reading

def load_packed(path: str | os.PathLike, dtype: str = "bfloat16") -> LoadedModel:
    """Read, verify and decode a `.w12` file; weights are the exact bf16 values, held in `dtype`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ModelFormatError(f"{path}: unreadable: {e.strerror or e}") from None
    return load_packed_bytes(data, str(path), dtype)


def load_packed_bytes(data: bytes, where: str = "<bytes>", dtype: str = "bfloat16") -> LoadedModel:
    """`load_packed` on the file's bytes; `where` names the file in errors."""
    header, blob = _read_header(data, where)
    try:
        cfg, params, tokenizer = _read_body(header, blob, where, dtype)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # checksums passed: a writer bug
        raise ModelFormatError(f"{where}: malformed packed model ({type(e).__name__}: {e})") from None
    return LoadedModel(name=where, cfg=cfg, params=params, tokenizer=tokenizer)


def _read_header(data: bytes, where: str) -> tuple[dict, bytes]:
    if len(data) < _PREFIX:
        raise ModelFormatError(f"{where}: truncated ({len(data)} bytes; a packed model starts with "
                               f"a {_PREFIX}-byte prefix)")
    if data[:len(MAGIC)] != MAGIC:
        raise ModelFormatError(f"{where}: not a specjax packed model (bad magic {data[:len(MAGIC)]!r})")
    n = int.from_bytes(data[8:16], "little")
    if n > len(data) - _PREFIX:
        raise ModelFormatError(f"{where}: truncated (the header says {n} bytes, the file has "
                               f"{len(data) - _PREFIX} after the prefix)")
    raw = data[_PREFIX:_PREFIX + n]
    if hashlib.sha256(raw).digest() != data[16:_PREFIX]:
        raise ModelFormatError(f"{where}: header checksum mismatch (the header was edited or damaged)")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ModelFormatError(f"{where}: header is not JSON: {e}") from None
    version = header.get("format_version") if isinstance(header, dict) else None
    if version != FORMAT_VERSION:
        raise ModelFormatError(f"{where}: format version {version!r} is not supported "
                               f"(this reader knows {FORMAT_VERSION})")
    return header, data[_PREFIX + n:]


def _read_body(header: dict, blob: bytes, where: str, dtype: str
               ) -> tuple[ModelConfig, ModelParams, Tokenizer | None]:
    planes_info = header["planes"]
    if len(blob) != planes_info["bytes"]:
        raise ModelFormatError(f"{where}: the plane data is {len(blob)} bytes, the header says "
                               f"{planes_info['bytes']} (truncated or extended)")
    index_end = 8 + int.from_bytes(blob[:8], "little")
    if index_end > len(blob) or _index_digest(blob) != planes_info["index_sha256"]:
        raise ModelFormatError(f"{where}: plane index checksum mismatch (the safetensors header "
                               "was damaged)")
    try:
        arrays = safetensors.numpy.load(blob)
    except Exception as e:  # safetensors raises its own error types for a damaged blob
        raise ModelFormatError(f"{where}: unreadable plane data: {e}") from None
    entries = header["tensors"]
    specs = {name: _plane_specs(name, entry, where) for name, entry in entries.items()}
    listed = {f"{name}/{k}" for name, spec in specs.items() for k in spec}
    if listed != set(arrays):
        raise ModelFormatError(f"{where}: the planes do not match the header "
                               f"(unlisted: {sorted(set(arrays) - listed)[:3]}, "
                               f"missing: {sorted(listed - set(arrays))[:3]})")
    for name, spec in specs.items():
        for k, (dt, shape) in spec.items():
            a = arrays[f"{name}/{k}"]
            if a.dtype != dt or a.shape != shape:
                raise ModelFormatError(f"{where}: tensor {name}: plane {k} is {a.dtype}{list(a.shape)}, "
                                       f"expected {np.dtype(dt)}{list(shape)}")
        digest = _tensor_digest(name, entries[name], [arrays[f"{name}/{k}"] for k in spec])
        if digest != entries[name]["sha256"]:
            raise ModelFormatError(f"{where}: tensor {name}: checksum mismatch (its planes or its "
                                   "header entry were damaged)")

    cfg_dict = dict(header["config"])
    scaling = cfg_dict.pop("rope_scaling")
    try:
        cfg = ModelConfig(**cfg_dict, rope_scaling=RopeScaling(**scaling) if scaling else None)
    except ConfigError as e:
        raise ModelFormatError(f"{where}: {e}") from None
    template = jax.eval_shape(lambda: init_random_params(cfg, jax.random.PRNGKey(0)))
    names = dict(_named_leaves(template))
    if set(names) != set(entries):
        raise ModelFormatError(f"{where}: the tensors do not match the config (missing: "
                               f"{sorted(set(names) - set(entries))[:3]}, "
                               f"unexpected: {sorted(set(entries) - set(names))[:3]})")
    held = cfg.with_dtype(dtype)
    values = []
    for name, leaf in names.items():
        entry = entries[name]
        if tuple(entry["shape"]) != leaf.shape:
            raise ModelFormatError(f"{where}: tensor {name} has shape {tuple(entry['shape'])}, "
                                   f"expected {leaf.shape} from the config")
        bits = _decode_entry(name, entry, arrays)
        values.append(jnp.asarray(bits.view(ml_dtypes.bfloat16), jnp.dtype(held.dtype)))
    params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), values)
    return held, params, _tokenizer_from_json(header["tokenizer"], where)


def _decode_entry(name: str, entry: dict, arrays: dict[str, np.ndarray]) -> np.ndarray:
    if entry["format"] == "bf16":
        return arrays[f"{name}/bf16"]
    return decode(Packed12(**{k: arrays[f"{name}/{k}"] for k in PLANES},
                           shape=tuple(entry["shape"]), base=int(entry["base"])))


# --------------------------------------------------------------------------- shared pieces

def _named_leaves(params) -> list[tuple[str, object]]:
    """("layers.3.w_qkv", leaf) for every array of a ModelParams tree, in tree order."""
    return [(jax.tree_util.keystr(path, simple=True, separator="."), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]


def _plane_specs(name: str, entry: dict, where: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The planes a header entry promises, in hashing order: name -> (dtype, shape)."""
    shape = tuple(int(d) for d in entry["shape"])
    if entry["format"] == "bf16":
        return {"bf16": (np.dtype(np.uint16), shape)}
    if entry["format"] == "lh12" and len(shape) == 2:
        return {k: (WORD, s) for k, s in plane_shapes(shape, int(entry["n_escape"])).items()}
    raise ModelFormatError(f"{where}: tensor {name}: format {entry['format']!r} of shape {list(shape)} "
                           "is not one this reader knows")


def _tensor_digest(name: str, entry: dict, planes: list[np.ndarray]) -> str:
    described = {"name": name, **{k: v for k, v in entry.items() if k != "sha256"}}
    h = hashlib.sha256(canonical_json(described).encode())
    for a in planes:
        h.update(np.ascontiguousarray(a).data)
    return h.hexdigest()


def _index_digest(blob: bytes) -> str:
    """sha256 of a safetensors blob's index (its 8-byte length and JSON header)."""
    return hashlib.sha256(blob[:8 + int.from_bytes(blob[:8], "little")]).hexdigest()


def _tokenizer_to_json(tok: Tokenizer | None) -> dict | None:
    if tok is None:
        return None
    return {"backend": tok.backend.to_str(), "eos_ids": [int(e) for e in tok.eos_ids],
            "bos_id": None if tok.bos_id is None else int(tok.bos_id), "add_bos": bool(tok.add_bos)}


def _tokenizer_from_json(d: dict | None, where: str) -> Tokenizer | None:
    if d is None:
        return None
    from tokenizers import Tokenizer as Backend
    try:
        backend = Backend.from_str(d["backend"])
    except Exception as e:  # tokenizers raises its own exception type
        raise ModelFormatError(f"{where}: unreadable tokenizer: {e}") from None
    return Tokenizer(backend, eos_ids=tuple(d["eos_ids"]), bos_id=d["bos_id"], add_bos=d["add_bos"])
