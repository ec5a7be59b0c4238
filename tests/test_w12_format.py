"""LH12 (specjax/weights/lh12.py): exact for every bf16 pattern, 12 bits for ordinary weights, the
documented plane layout, and the JAX (kernel-reference) decoder equal to the numpy one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from specjax.weights.lh12 import (LAYOUT, PLANES, choose_format, decode, decode_jax, encode, encode_jax,
                                  lh12_bits, plane_shapes)

ALL = np.arange(1 << 16, dtype=np.uint16)


def bf16_bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def assert_round_trip(w: np.ndarray, check_jax: bool = True):
    p = encode(w)
    assert {k: getattr(p, k).shape for k in PLANES} == plane_shapes(w.shape, p.n_escape)
    np.testing.assert_array_equal(decode(p), w)
    if check_jax:
        np.testing.assert_array_equal(np.asarray(decode_jax(p)), w)
    return p


def patterns(pred) -> np.ndarray:
    """Every bf16 pattern whose (sign, exponent, mantissa) satisfies pred."""
    sign, exp, man = ALL >> 15, (ALL >> 7) & 0xFF, ALL & 0x7F
    return ALL[pred(sign, exp, man)]


def test_every_pattern_round_trips_as_one_tensor():
    for shape in [(1, 1 << 16), (256, 256)]:
        assert_round_trip(ALL.reshape(shape))


@pytest.mark.parametrize("shape", [(128, 512), (2048, 32), (655, 100), (9, 7281)])
def test_every_pattern_round_trips_shuffled(shape):
    """Shuffled, so every segment mixes specials and normals; widths that are not multiples of 8
    or 64 exercise the padded super-word and the partial last segment."""
    w = np.random.default_rng(sum(shape)).permutation(ALL)[:shape[0] * shape[1]].reshape(shape)
    assert_round_trip(w)


@pytest.mark.parametrize("kind", ["nan", "inf", "denormal", "zero", "mixed"])
def test_special_tensors(kind):
    rng = np.random.default_rng(7)
    pools = {
        "nan": patterns(lambda s, e, m: (e == 255) & (m != 0)),  # every NaN payload, both signs
        "inf": patterns(lambda s, e, m: (e == 255) & (m == 0)),
        "denormal": patterns(lambda s, e, m: (e == 0) & (m != 0)),
        "zero": patterns(lambda s, e, m: (e == 0) & (m == 0)),
    }
    pools["mixed"] = np.concatenate([*pools.values(), bf16_bits(rng.normal(0, 0.02, 1000))])
    w = rng.choice(pools[kind], size=(96, 200))
    w[0, :len(pools[kind][:200])] = pools[kind][:200]  # each pattern at least once
    p = assert_round_trip(w)
    if kind == "mixed":
        assert p.n_escape > 0.9 * 96 * 4  # nearly every segment holds patterns 2^100 apart
    else:  # one exponent (pair): the window covers it, no escapes
        assert p.n_escape == 0 and p.bits_per_weight < 12.1


def test_escape_heavy_tensor_round_trips_and_stays_bf16():
    rng = np.random.default_rng(3)
    w = bf16_bits(rng.normal(0, 0.02, (64, 1024)))
    # a zero (exponent 0) in every segment: segment s holds super-words 8s..8s+7, and element 0 of
    # super-word m is column m (stripe 0)
    w[:, :1024 // LAYOUT.group:LAYOUT.segment // LAYOUT.group] = 0
    p = assert_round_trip(w)
    assert p.n_escape == 64 * 16 and 15.9 < p.bits_per_weight < 16.1
    choice = choose_format(w)
    assert choice.format == "bf16" and choice.escape_fraction == 1.0 and choice.bits_per_weight == 16.0
    assert "100.0% of 64-weight segments escape" in choice.reason


def test_choose_format():
    rng = np.random.default_rng(4)
    w = bf16_bits(rng.normal(0, 0.02, (256, 512)))
    choice = choose_format(w)
    assert choice.format == "lh12" and choice.bits_per_weight == encode(w).bits_per_weight < 12.1
    assert choice.num_weights == w.size
    w[:, ::640] = 0  # 10.9% of segments escape: just past the limit
    assert choose_format(w).format == "bf16"
    assert choose_format(bf16_bits(rng.normal(1, 0.1, 576))).format == "bf16"  # a norm vector
    with pytest.raises(ValueError, match="uint16"):
        choose_format(rng.normal(size=(4, 4)))


def test_random_normal_weights_take_12_bits_plus_little_metadata():
    w = bf16_bits(np.random.default_rng(5).normal(0, 0.02, (1024, 4096)))
    p = assert_round_trip(w, check_jax=False)
    n = w.size
    assert 8 * (p.lo.nbytes + p.code.nbytes) / n == 12.0
    assert 8 * (p.flag.nbytes + p.ovbase.nbytes) / n == 1 / 32
    assert 8 * p.ov.nbytes / n < 0.05  # |w| < 2^-19: ~0.5% of segments
    assert p.bits_per_weight == 8 * p.nbytes / n == lh12_bits(w.shape, p.n_escape) < 12.1


def test_window_leaves_fewest_escape_segments():
    """The base is chosen on escaped segments (what escapes cost), checked against brute force."""
    rng = np.random.default_rng(6)
    for trial in range(20):
        e2 = rng.integers(50, 70, size=(8, 256)) + rng.integers(0, 3, size=(8, 1)) * trial % 5
        w = ((e2 << 8) | rng.integers(0, 256, size=e2.shape)).astype(np.uint16)
        segs = e2.reshape(8, -1, LAYOUT.segment)
        best = min(int((~((segs >= b) & (segs <= b + 7)).all(-1)).sum()) for b in range(121))
        assert encode(w).n_escape == best


def test_plane_layout_is_the_documented_one():
    """The word layout a kernel relies on, spelled out for one row of 72 weights: M = 9 super-words,
    super-word m holds columns m, m + 9, ..., m + 63 (stripes); segment 1 is super-word 8 alone."""
    h = np.array([60, 61, 62, 63, 0xC0, 67, 0xBF, 60] + [62] * 64, np.uint16)  # high bytes
    lo = np.arange(72, dtype=np.uint16)
    w = ((h << 8) | lo)[None, :]
    p = encode(w)
    assert p.base == 60 and p.n_escape == 0  # exp>>1 in 60..67 (0xC0 is sign | 64, 0xBF sign | 63)
    assert p.lo.shape == (1, 18) and p.code.shape == (1, 9)
    col = lambda m, i: 9 * i + m  # column of element i of super-word m
    for m in range(9):
        assert p.lo[0, m] == sum(col(m, i) << (8 * i) for i in range(4))  # low bytes = column index
        assert p.lo[0, 9 + m] == sum(col(m, 4 + i) << (8 * i) for i in range(4))
    code = {0: 0, 1: 1, 2: 2, 3: 3, 4: 8 | 4, 5: 7, 6: 8 | 3, 7: 0}  # sign << 3 | (exp>>1 - base)
    c = lambda n: code.get(n, 2)
    assert p.code[0, 0] == sum((c(col(0, i)) | c(col(0, i + 4)) << 4) << (8 * i) for i in range(4))
    assert p.code[0, 4] == sum((c(col(4, i)) | c(col(4, i + 4)) << 4) << (8 * i) for i in range(4))
    assert p.flag.tolist() == [0] and p.ovbase.tolist() == [0]

    w[0, 71] = 0x7FC1  # a NaN at column 71 = element 7 of super-word 8: segment 1 escapes
    p = encode(w)
    assert p.n_escape == 1 and p.flag.tolist() == [0b10] and p.ovbase.tolist() == [0]
    assert p.ov.shape == (1, 8)
    # element 7 = byte 3, high nibble of super-word 8 (word 0 of the segment's overflow words)
    assert (p.code[0, 8] >> 28) & 0xF == 0x7F & 0xF and (p.ov[0, 0] >> 28) & 0xF == 0x7F >> 4
    np.testing.assert_array_equal(decode(p), w)


@pytest.mark.parametrize("seed", range(6))
def test_decode_jax_equals_numpy_decode(seed):
    """Fresh inputs with escape and plain segments, odd shapes, and many flag words."""
    rng = np.random.default_rng(100 + seed)
    rows, cols = int(rng.integers(1, 40)), int(rng.integers(1, 1200))
    w = bf16_bits(rng.normal(0, 10.0 ** rng.uniform(-3, 0), (rows, cols)))
    specials = rng.random(w.shape) < 10.0 ** rng.uniform(-4, -1)
    w[specials] = rng.integers(0, 1 << 16, int(specials.sum()), dtype=np.uint16)
    p = encode(w)
    expect = decode(p)
    np.testing.assert_array_equal(np.asarray(decode_jax(p)), expect)
    np.testing.assert_array_equal(np.asarray(jax.jit(decode_jax)(p)), expect)
    np.testing.assert_array_equal(expect, w)


@pytest.mark.parametrize("seed", range(3))
def test_device_encoder_equals_numpy_encoder(seed):
    """encode_jax (what benchmarks pack 8B-shaped models with) writes the very same planes."""
    rng = np.random.default_rng(200 + seed)
    rows, cols = int(rng.integers(1, 70)), int(rng.integers(1, 2100))
    w = bf16_bits(rng.normal(0, 0.02, (rows, cols)))
    specials = rng.random(w.shape) < 10.0 ** rng.uniform(-4, -1.5)
    w[specials] = rng.integers(0, 1 << 16, int(specials.sum()), dtype=np.uint16)
    p, q = encode(w), encode_jax(w)
    assert (q.base, q.shape) == (p.base, p.shape)
    for name in PLANES:
        np.testing.assert_array_equal(np.asarray(getattr(q, name)), getattr(p, name), err_msg=name)


def test_device_encoder_compiles_once_per_shape_and_escape_bucket():
    """Tensors of one shape with other window bases and escape counts (3 and 4 share the bucket of
    4) reuse one compiled encoder, and still write the numpy encoder's planes (a model of 120
    tensors spent 199 s packing on an H100 when each compiled its own)."""
    from specjax.weights import lh12
    rng = np.random.default_rng(7)
    ws = []
    for scale, n_special in [(0.01, 3), (0.3, 4), (3.0, 3)]:
        w = bf16_bits(rng.choice([-1, 1], (48, 200)) * rng.uniform(1, 2, (48, 200)) * scale)  # one binade
        w[rng.choice(48, n_special, replace=False), 0] = 0x7F80  # +inf: one escape segment a row
        ws.append(w)
    lh12._encode_planes_jax.clear_cache()
    packed = [encode_jax(w) for w in ws]
    assert len({q.base for q in packed}) == 3 and [q.n_escape for q in packed] == [3, 4, 3]
    assert lh12._encode_planes_jax._cache_size() == 1
    for w, q in zip(ws, packed):
        p = encode(w)
        for name in PLANES:
            np.testing.assert_array_equal(np.asarray(getattr(q, name)), getattr(p, name), err_msg=name)


def test_empty_and_bad_inputs():
    for shape in [(0, 5), (3, 0)]:
        assert_round_trip(np.zeros(shape, np.uint16))
    with pytest.raises(ValueError, match="2-D uint16"):
        encode(np.zeros((2, 2, 2), np.uint16))
    with pytest.raises(ValueError, match="2-D uint16"):
        encode(np.zeros((2, 8), np.float32))


def test_every_smollm2_tensor_round_trips(smollm2):
    formats = {}
    for path, x in jax.tree_util.tree_flatten_with_path(smollm2.params)[0]:
        bits = np.asarray(jnp.asarray(x, jnp.bfloat16)).view(np.uint16)
        bits = bits.reshape(1, -1) if bits.ndim == 1 else bits
        p = encode(bits)
        np.testing.assert_array_equal(decode(p), bits, err_msg=jax.tree_util.keystr(path))
        formats[jax.tree_util.keystr(path)] = p.bits_per_weight
    matrices = [b for name, b in formats.items() if name.endswith(("w_qkv", "w_o", "w_gate_up", "w_down"))]
    assert len(matrices) == 4 * 30 and max(matrices) < 12.5
