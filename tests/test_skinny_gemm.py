"""The skinny GEMM kernels (pallas_kernels/skinny_gemm*.py) in Pallas interpret mode, on fresh
random inputs: equal to their pure-JAX references, the 12-bit kernel bitwise equal to the bf16
kernel on the same weights, and every row's result independent of how many rows came with it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.skinny_gemm import (GemmConfig, default_config, prepare_bf16, skinny_gemm,
                                        skinny_gemm_reference, unprepare_bf16)
from pallas_kernels.skinny_gemm_lh12 import (dense_lh12, pack_for_kernel, prepare_lh12, skinny_gemm_lh12,
                                             skinny_gemm_lh12_reference, unprepare_lh12)
from specjax.weights.lh12 import PLANES, encode


def random_case(seed: int, specials: bool = True):
    """A [K, N] bf16 weight (as bits) with escapes (zeros, denormals, outliers), x [T, K], a config."""
    rng = np.random.default_rng(seed)
    k, n, t = int(rng.integers(16, 300)), int(rng.integers(8, 700)), int(rng.integers(1, 70))
    w = rng.normal(0, 10.0 ** rng.uniform(-3, 0), (k, n)).astype(ml_dtypes.bfloat16).view(np.uint16)
    if specials:
        pick = rng.random(w.shape) < 10.0 ** rng.uniform(-4, -1.5)
        pool = np.array([0, 0x8000, 0x0001, 0x807F, 0x4780, 0xC500], np.uint16)  # ±0, denormals, 2^16, -2^11
        w[pick] = rng.choice(pool, int(pick.sum()))
    x = jnp.asarray(rng.normal(0, 1, (t, k)), jnp.bfloat16)
    cfg = GemmConfig(block_n=int(rng.choice([128, 256])), block_k=int(rng.choice([16, 32, 64])),
                     split_k=int(rng.integers(1, 4)))
    return w, x, cfg


def bits(y) -> np.ndarray:
    return np.asarray(y, np.float32).view(np.uint32)


@pytest.mark.parametrize("seed", range(5))
def test_bf16_kernel_equals_reference(seed):
    w, x, cfg = random_case(seed)
    wj = jnp.asarray(w.view(ml_dtypes.bfloat16))
    y = skinny_gemm(x, prepare_bf16(wj, cfg, interpret=True))
    ref = skinny_gemm_reference(x, wj)
    assert y.shape == ref.shape and y.dtype == jnp.float32
    err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    assert err < 1e-6, err  # float32 sums of exact bf16 products, in another order


@pytest.mark.parametrize("seed", range(5))
def test_lh12_kernel_equals_reference_and_bf16_kernel_bitwise(seed):
    w, x, cfg = random_case(10 + seed)
    p = encode(w)
    assert p.n_escape > 0 or seed > 2  # the escape path is exercised
    y12 = skinny_gemm_lh12(x, prepare_lh12(p, cfg, interpret=True))
    for lookup, decode, one_dot in (("segment", "swar", False), ("masked", "prmt", True)):
        # (prmt runs as SWAR on a CPU: the device benchmark checks the PTX path bitwise)
        other = dataclasses.replace(cfg, escape_lookup=lookup, decode=decode, one_dot=one_dot)
        np.testing.assert_array_equal(bits(skinny_gemm_lh12(x, prepare_lh12(p, other, interpret=True))),
                                      bits(y12))
    ref = skinny_gemm_lh12_reference(x, p)
    assert float(jnp.linalg.norm(y12 - ref) / jnp.linalg.norm(ref)) < 1e-6
    y16 = skinny_gemm(x, prepare_bf16(jnp.asarray(w.view(ml_dtypes.bfloat16)), cfg, interpret=True))
    np.testing.assert_array_equal(bits(y12), bits(y16))


def test_all_special_weights_bitwise():
    """NaN payloads, infinities, zeros and denormals: the 12-bit kernel reproduces the bf16 kernel's
    every output bit (a NaN where it has a NaN: which NaN payload arithmetic yields is unspecified),
    since it rebuilds the exact weights before multiplying."""
    rng = np.random.default_rng(3)
    pool = np.concatenate([np.arange(0x7F80, 0x8000), np.arange(0xFF80, 0x10000), np.arange(0, 0x80),
                           np.arange(0x8000, 0x8080)]).astype(np.uint16)
    w = rng.choice(pool, (64, 200))
    w[:, 1::3] = np.asarray(rng.normal(0, 0.05, (64, 67)), ml_dtypes.bfloat16).view(np.uint16)
    x = jnp.asarray(rng.normal(0, 1, (3, 64)), jnp.bfloat16)
    cfg = GemmConfig(block_n=128, block_k=32, split_k=2)
    y12 = skinny_gemm_lh12(x, prepare_lh12(encode(w), cfg, interpret=True))
    y16 = skinny_gemm(x, prepare_bf16(jnp.asarray(w.view(ml_dtypes.bfloat16)), cfg, interpret=True))
    nan = np.isnan(np.asarray(y16))
    assert nan.any() and not nan.all()
    np.testing.assert_array_equal(np.isnan(np.asarray(y12)), nan)
    np.testing.assert_array_equal(bits(y12)[~nan], bits(y16)[~nan])


@pytest.mark.parametrize("seed", range(3))
def test_row_results_do_not_depend_on_row_count(seed):
    """A verify step (T rows) must reproduce an AR step's row bit for bit."""
    w, x, cfg = random_case(20 + seed)
    x = jnp.concatenate([x] * 3)[:40]
    for gw in (prepare_bf16(jnp.asarray(w.view(ml_dtypes.bfloat16)), cfg, interpret=True),
               prepare_lh12(encode(w), cfg, interpret=True)):
        gemm = skinny_gemm if gw.__class__.__name__ == "GemmWeight" else skinny_gemm_lh12
        full = bits(gemm(x, gw))
        for t in (0, 15, 16, 39):
            np.testing.assert_array_equal(bits(gemm(x[t:t + 1], gw))[0], full[t])
        np.testing.assert_array_equal(bits(gemm(x[5:22], gw)), full[5:22])


@pytest.mark.parametrize("t", [65, 100, 160])
def test_steps_past_one_program_of_rows_keep_every_row_bitwise(t):
    """Past ROWS_PER_PROGRAM rows (a batch-32 verify step) the rows split over a third grid axis,
    the last block's chunks sliding back: each row equals its 1-row result, bit for bit, and the
    12-bit kernel the bf16 one."""
    w, _, cfg = random_case(30 + t)
    x = jnp.asarray(np.random.default_rng(t).normal(0, 1, (t, w.shape[0])), jnp.bfloat16)
    wj = jnp.asarray(w.view(ml_dtypes.bfloat16))
    g16, g12 = prepare_bf16(wj, cfg, interpret=True), prepare_lh12(encode(w), cfg, interpret=True)
    full = bits(skinny_gemm(x, g16))
    assert full.shape == (t, w.shape[1])
    np.testing.assert_array_equal(bits(skinny_gemm_lh12(x, g12)), full)
    for r in (0, 63, 64, t - 17, t - 1):
        np.testing.assert_array_equal(bits(skinny_gemm(x[r:r + 1], g16))[0], full[r])
    ref = skinny_gemm_reference(x, wj)
    assert float(jnp.linalg.norm(full.view(np.float32) - ref) / jnp.linalg.norm(ref)) < 1e-6


def test_speed_knobs_leave_numerics_alone():
    """block_n and the launch knobs change speed only: outputs stay bitwise equal."""
    w, x, _ = random_case(30)
    wj = jnp.asarray(w.view(ml_dtypes.bfloat16))
    outs = [bits(skinny_gemm(x, prepare_bf16(wj, GemmConfig(block_n=bn, block_k=32, split_k=2,
                                                             num_warps=nw), interpret=True)))
            for bn, nw in ((128, 4), (256, 8), (512, 4))]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_prepare_round_trips_and_pads():
    w, _, cfg = random_case(40)
    wj = jnp.asarray(w.view(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(np.asarray(unprepare_bf16(prepare_bf16(wj, cfg))), np.asarray(wj))
    p = encode(w)
    back = unprepare_lh12(prepare_lh12(p, cfg))
    for name in PLANES:
        np.testing.assert_array_equal(np.asarray(getattr(back, name)), getattr(p, name), err_msg=name)
    np.testing.assert_array_equal(np.asarray(dense_lh12(prepare_lh12(p, cfg))).view(np.uint16), w)


def test_config_checks_and_default():
    for bad in (dict(block_n=100), dict(block_n=64), dict(block_k=48), dict(split_k=0),
                dict(escape_lookup="row")):
        with pytest.raises(ValueError):
            GemmConfig(**bad)
    cfg = default_config((14336, 4096))
    assert (14336 // cfg.block_k) % cfg.split_k == 0 and cfg.split_k > 1  # no padded copy of K
    assert default_config((4096, 128256)).split_k == 1  # enough programs along N already
    for shape in ((14336, 4096), (4096, 6144), (40, 300)):  # per-format speed, shared numerics
        assert default_config(shape, "lh12").numerics == default_config(shape, "bf16").numerics
    assert default_config((64, 64), "lh12").one_dot
    with pytest.raises(ValueError, match="weight format"):
        default_config((64, 64), "fp8")
    with pytest.raises(ValueError, match="weight is"):
        skinny_gemm(jnp.ones((2, 5)), prepare_bf16(jnp.ones((6, 16)), GemmConfig(), interpret=True))


def test_jit_of_kernel_weights():
    """Prepared weights are pytrees with static layout: a jitted caller traces them like arrays."""
    w, x, cfg = random_case(50, specials=False)
    gw = prepare_lh12(encode(w), cfg, interpret=True)
    f = jax.jit(lambda x, gw: skinny_gemm_lh12(x, gw) * 2)
    np.testing.assert_array_equal(bits(f(x, gw)), bits(skinny_gemm_lh12(x, gw) * 2))


def test_decode_rows_are_not_padded_in_hbm():
    """T = 1 (any T) feeds x to the kernels as it is: no pad op runs before the GEMM."""
    rng = np.random.default_rng(7)
    w = rng.normal(0, 0.05, (128, 200)).astype(ml_dtypes.bfloat16).view(np.uint16)
    cfg = GemmConfig(block_n=128, block_k=32, split_k=2)
    x = jnp.asarray(rng.normal(0, 1, (3, 128)), jnp.bfloat16)
    for gw, gemm in ((prepare_bf16(jnp.asarray(w.view(ml_dtypes.bfloat16)), cfg, interpret=True), skinny_gemm),
                     (prepare_lh12(encode(w), cfg, interpret=True), skinny_gemm_lh12)):
        for t in (1, 3):
            jaxpr = str(jax.make_jaxpr(gemm)(x[:t], gw))
            assert "pad[" not in jaxpr, jaxpr[:3000]
            np.testing.assert_array_equal(bits(gemm(x[:t], gw)), bits(gemm(x, gw))[:t])


@pytest.mark.parametrize("seed", range(3))
def test_natural_order_packing_skips_the_transpose_and_stays_bitwise(seed):
    """One-dot 12-bit weights packed in natural order: no transpose after the kernel, the same bits
    as the bf16 kernel, and `dense_lh12` still gives W back."""
    rng = np.random.default_rng(40 + seed)
    k, n, t = 64 * int(rng.integers(1, 4)), 8 * int(rng.integers(20, 90)), int(rng.integers(1, 40))
    w = rng.normal(0, 0.02, (k, n)).astype(ml_dtypes.bfloat16).view(np.uint16)
    w[rng.random(w.shape) < 0.01] = 0x4780  # escapes
    cfg = GemmConfig(block_n=128, block_k=32, split_k=int(rng.integers(1, 3)), escape_lookup="masked",
                     one_dot=True)
    x = jnp.asarray(rng.normal(0, 1, (t, k)), jnp.bfloat16)
    packed, permuted = pack_for_kernel(jnp.asarray(w), cfg)
    assert permuted
    lw = prepare_lh12(packed, cfg, interpret=True, permuted=True)
    assert lw.natural
    jaxpr = str(jax.make_jaxpr(skinny_gemm_lh12)(x, lw))
    assert "transpose[" not in jaxpr
    gw = prepare_bf16(jnp.asarray(w.view(ml_dtypes.bfloat16)), cfg, interpret=True)
    np.testing.assert_array_equal(bits(skinny_gemm_lh12(x, lw)), bits(skinny_gemm(x, gw)))
    np.testing.assert_array_equal(np.asarray(dense_lh12(lw)).view(np.uint16), w)
    # the format's own planes, permuted inside prepare_lh12: the same weight
    lw2 = prepare_lh12(encode(w), cfg, interpret=True)
    assert lw2.natural
    np.testing.assert_array_equal(bits(skinny_gemm_lh12(x, lw2)), bits(skinny_gemm(x, gw)))


@pytest.mark.parametrize("seed", range(2))
def test_wide_step_settings_keep_every_row_bitwise(seed):
    """A config's `wide` settings (T > 16 rows) change speed only: a 40-row step under them equals
    1-row steps under the base settings bit for bit, in both formats."""
    w, x, cfg = random_case(50 + seed)
    x = jnp.concatenate([x] * 3)[:40]
    wide = dataclasses.replace(cfg, num_warps=8, num_stages=2, decode="prmt")
    cfg = dataclasses.replace(cfg, wide=wide)
    assert cfg.for_rows(16) is cfg and cfg.for_rows(17) is wide
    for gw in (prepare_bf16(jnp.asarray(w.view(ml_dtypes.bfloat16)), cfg, interpret=True),
               prepare_lh12(encode(w), cfg, interpret=True)):
        gemm = skinny_gemm if gw.__class__.__name__ == "GemmWeight" else skinny_gemm_lh12
        full = bits(gemm(x, gw))
        for t in (0, 17, 39):
            np.testing.assert_array_equal(bits(gemm(x[t:t + 1], gw))[0], full[t])


def test_wide_settings_must_keep_numerics_and_layout():
    base = GemmConfig(block_n=256, block_k=32, split_k=2)
    with pytest.raises(ValueError, match="numerics"):
        dataclasses.replace(base, wide=dataclasses.replace(base, split_k=1))
    with pytest.raises(ValueError, match="no wide config"):
        dataclasses.replace(base, wide=dataclasses.replace(base, wide=base))
    narrow = dataclasses.replace(base, wide=dataclasses.replace(base, block_n=128))
    w = jnp.zeros((64, 512), jnp.bfloat16)
    prepare_bf16(w, narrow, interpret=True)  # bf16: N = 512 pads to the same width either way
    with pytest.raises(ValueError, match="layout"):
        prepare_bf16(jnp.zeros((64, 300), jnp.bfloat16), narrow, interpret=True)  # 384 vs 512 columns
    with pytest.raises(ValueError, match="layout"):  # LH12 counts escapes per block_n tile
        prepare_lh12(encode(np.zeros((64, 512), np.uint16)), narrow, interpret=True)
    # a cache round trip: the nested config comes back from its dict
    assert GemmConfig(**dataclasses.asdict(narrow)) == narrow


def test_one_kernel_serves_every_lh12_tensor_of_a_shape():
    """The window base is data and `ov` is padded to a power-of-two row count, so two tensors of
    one shape with other bases and escape counts lower to the same kernel (one trace, one Triton
    compile for all of a model's layers, not one per tensor), and both still equal the bf16 kernel
    bitwise."""
    from pallas_kernels.skinny_gemm_lh12 import _skinny_gemm_lh12
    _skinny_gemm_lh12.clear_cache()
    rng = np.random.default_rng(21)
    k, n = 64, 256
    cfg = GemmConfig(block_n=128, block_k=32, split_k=2)
    x = jnp.asarray(rng.normal(0, 1, (3, k)), jnp.bfloat16)
    jaxprs = []
    for scale, n_specials in ((1e-3, 2), (3.0, 3)):
        a = np.clip(np.abs(rng.normal(0, 1, (k, n))), 2.0 ** -6, 2.0 ** 5)  # 12 exponents: inside a window
        w = (scale * a * rng.choice([-1, 1], (k, n))).astype(ml_dtypes.bfloat16).view(np.uint16)
        w.reshape(-1)[rng.choice(w.size // 64, n_specials, replace=False) * 64] = 0x4780  # 2^16: one escape each
        p = encode(w)
        lw = prepare_lh12(p, cfg, interpret=True)
        assert p.n_escape == n_specials and lw.ov.shape == (8 * 4,)
        jaxprs.append((p.base, str(jax.make_jaxpr(skinny_gemm_lh12)(x, lw))))
        y16 = skinny_gemm(x, prepare_bf16(jnp.asarray(w.view(ml_dtypes.bfloat16)), cfg, interpret=True))
        np.testing.assert_array_equal(bits(skinny_gemm_lh12(x, lw)), bits(y16))
        assert unprepare_lh12(lw).ov.shape == (n_specials, 8)
    (base_a, jaxpr_a), (base_b, jaxpr_b) = jaxprs
    assert base_a != base_b and jaxpr_a == jaxpr_b
    assert _skinny_gemm_lh12._cache_size() == 1  # one trace served both tensors
