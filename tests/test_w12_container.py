"""`.w12` packed models (specjax/weights/container.py): exact round trip, every corruption refused
with ModelFormatError (and nothing else), the same greedy tokens as the bf16 model, and the CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import save_tiny_checkpoint, tiny_model
from specjax.atomic import canonical_json
from specjax.cli import main
from specjax.decoding.sequences import GenerationConfig
from specjax.engine import Decoder
from specjax.errors import ModelFormatError, SpecJaxError
from specjax.models.loading import LoadedModel, load_model
from specjax.models.params import cast_params
from specjax.tokenizer import Tokenizer
from specjax.weights.container import load_packed, load_packed_bytes, pack_model, packed_bytes

PREFIX = 8 + 8 + 32  # magic, header length, header sha256


def bits_of(params) -> list[np.ndarray]:
    return [np.asarray(x).astype(jnp.bfloat16).view(np.uint16) for x in jax.tree.leaves(params)]


def assert_same_weights(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(bits_of(a), bits_of(b)):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers
    backend = Backend(models.WordLevel(vocab={c: i for i, c in enumerate("<abcdefgh ijklmnop")},
                                       unk_token="<"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    cfg, params = tiny_model(num_layers=2)
    return LoadedModel("tiny", cfg.with_dtype("bfloat16"), cast_params(params, jnp.bfloat16),
                       Tokenizer(backend, eos_ids=(0,), bos_id=1, add_bos=True))


@pytest.fixture(scope="module")
def tiny_bytes(tiny) -> bytes:
    return packed_bytes(tiny)[0]


def test_round_trip(tiny, tiny_bytes, tmp_path):
    assert len(tiny_bytes) < 64_000
    loaded = load_packed_bytes(tiny_bytes)
    assert loaded.cfg == tiny.cfg
    assert_same_weights(loaded.params, tiny.params)
    tok = loaded.tokenizer
    assert (tok.eos_ids, tok.bos_id, tok.add_bos) == ((0,), 1, True)
    assert tok.encode("abc hop") == tiny.tokenizer.encode("abc hop")

    choices = pack_model(tiny, tmp_path / "t.w12")
    assert (tmp_path / "t.w12").read_bytes() == tiny_bytes
    assert choices["layers.0.w_qkv"].format == "lh12" and choices["final_norm"].format == "bf16"
    assert os.listdir(tmp_path) == ["t.w12"]  # no temp file left
    as_f32 = load_model(str(tmp_path / "t.w12"))  # load_model's default dtype: an exact upcast
    assert as_f32.cfg.dtype == "float32" and as_f32.params.embed.dtype == jnp.float32
    assert_same_weights(as_f32.params, tiny.params)


def test_failed_write_keeps_the_old_file(tiny, tiny_bytes, tmp_path, monkeypatch):
    target = tmp_path / "t.w12"
    target.write_bytes(b"old")
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(SpecJaxError, match="cannot write: No space left"):
        pack_model(tiny, target)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["t.w12"]


def _header(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[8:16], "little")
    return json.loads(data[PREFIX:PREFIX + n]), data[PREFIX + n:]


def _with_header(data: bytes, header: dict, resign: bool) -> bytes:
    raw = canonical_json(header).encode()
    raw += b" " * (-len(raw) % 8)
    sha = hashlib.sha256(raw).digest() if resign else data[16:PREFIX]
    return data[:8] + len(raw).to_bytes(8, "little") + sha + raw + _header(data)[1]


def _edit_leaf(obj, rng: random.Random):
    """Change (or delete) one randomly chosen leaf of a JSON tree, in place."""
    while True:
        keys = list(obj) if isinstance(obj, dict) else list(range(len(obj)))
        key = rng.choice(keys)
        if isinstance(obj[key], (dict, list)) and obj[key] and rng.random() < 0.8:
            obj = obj[key]
            continue
        value = obj[key]
        if isinstance(obj, dict) and rng.random() < 0.1:
            del obj[key]
        elif isinstance(value, bool) or value is None:
            obj[key] = not value
        elif isinstance(value, (int, float)):
            obj[key] = value + rng.choice([-1, 1, 3])
        elif isinstance(value, str) and value:
            i = rng.randrange(len(value))
            obj[key] = value[:i] + ("x" if value[i] != "x" else "y") + value[i + 1:]
        else:
            obj[key] = 0
        return


def corruptions(data: bytes, rng: random.Random):
    """(kind, corrupted bytes): 3000 bit flips, 3000 byte changes, 2000 truncations, 1000 header
    edits with the stale header checksum and 1000 re-signed edits of the tensor and plane entries
    (caught by the per-tensor checksums and the plane index checksum)."""
    header, _ = _header(data)
    for _ in range(3000):
        d = bytearray(data)
        d[rng.randrange(len(d))] ^= 1 << rng.randrange(8)
        yield "bit flip", bytes(d)
    for _ in range(3000):
        d = bytearray(data)
        i = rng.randrange(len(d))
        d[i] = (d[i] + rng.randrange(1, 256)) % 256
        yield "byte change", bytes(d)
    for _ in range(2000):
        yield "truncation", data[:rng.randrange(len(data))]
    for resign in (False, True):
        for _ in range(1000):
            h = json.loads(json.dumps(header))
            _edit_leaf(h[rng.choice(["tensors", "planes"])] if resign else h, rng)
            assert h != header
            yield "re-signed header edit" if resign else "header edit", _with_header(data, h, resign)


def test_corruptions_are_refused(tiny_bytes):
    missed, wrong_type, n = [], [], 0
    for kind, bad in corruptions(tiny_bytes, random.Random(0)):
        n += 1
        try:
            load_packed_bytes(bad, "t.w12")
            missed.append(kind)
        except ModelFormatError as e:
            assert str(e).startswith("t.w12: ")
        except Exception as e:  # noqa: BLE001 - the point is that nothing else escapes
            wrong_type.append((kind, repr(e)))
    assert n == 10_000
    assert not missed, f"{len(missed)} corruptions loaded: {missed[:5]}"
    assert not wrong_type, f"{len(wrong_type)} raised other errors: {wrong_type[:5]}"


def test_errors_name_the_file_and_the_tensor(tiny_bytes, tmp_path):
    _, blob = _header(tiny_bytes)
    index = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    start = len(tiny_bytes) - len(blob) + 8 + int.from_bytes(blob[:8], "little")
    begin, end = index["layers.1.w_gate_up/code"]["data_offsets"]
    d = bytearray(tiny_bytes)
    d[start + (begin + end) // 2] ^= 0x10
    path = tmp_path / "bad.w12"
    path.write_bytes(bytes(d))
    with pytest.raises(ModelFormatError, match=rf"^{path}: tensor layers.1.w_gate_up: checksum mismatch"):
        load_model(str(path))
    path.write_bytes(tiny_bytes[:1000])
    with pytest.raises(ModelFormatError, match=rf"^{path}: truncated"):
        load_packed(path)
    with pytest.raises(ModelFormatError, match="no.w12: unreadable"):
        load_packed(tmp_path / "no.w12")


def test_packed_smollm2_generates_the_same_tokens(smollm2, tmp_path):
    bf16 = dataclasses.replace(smollm2, cfg=smollm2.cfg.with_dtype("bfloat16"),
                               params=cast_params(smollm2.params, jnp.bfloat16))
    choices = pack_model(bf16, tmp_path / "smollm2.w12")
    assert choices["layers.0.w_down"].format == "lh12" and choices["layers.0.mlp_norm"].format == "bf16"
    packed = load_model(str(tmp_path / "smollm2.w12"), dtype="bfloat16")
    assert packed.cfg == bf16.cfg
    assert_same_weights(packed.params, bf16.params)

    tok = bf16.tokenizer
    prompts = [tok.encode("def fibonacci(n):"), tok.encode("The capital of France is")]
    decoder = Decoder(bf16.cfg, bf16.params, GenerationConfig(max_new_tokens=16))
    expect = decoder.generate(prompts).tokens
    decoder.params = packed.params  # the same compiled program, fed the packed model's weights
    got = decoder.generate(prompts).tokens
    assert got == expect and all(len(t) == 16 for t in got)
    assert packed.tokenizer.encode("def fibonacci(n):") == prompts[0]


def test_cli_pack(capsys, tmp_path):
    src = save_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "out" / "tiny.w12"
    capsys.readouterr()
    assert main(["pack", str(src), str(out)]) == 0
    line = capsys.readouterr().out
    assert line.startswith(f"{out}: ") and "tensors in LH12" in line and "bits/weight" in line
    assert_same_weights(load_model(str(out), dtype="bfloat16").params,
                        load_model(str(src), dtype="bfloat16").params)

    for argv, needle in [([str(tmp_path / "nope"), str(out)], "no such file or directory"),
                         ([str(src), str(tmp_path / "x.bin")], "must end in .w12")]:
        assert main(["pack", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("specjax: error:") and err.count("\n") == 1 and needle in err, err
