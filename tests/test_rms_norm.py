"""The RMSNorm kernel (pallas_kernels/rms_norm.py) in Pallas interpret mode, on fresh random shapes:
equal to its reference within one rounding, and a row's result independent of how many rows the
call holds (what keeps AR and verify steps bit-identical on the kernel path)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.rms_norm import NormConfig, default_norm_config, rms_norm, rms_norm_reference


def f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), d=st.sampled_from([64, 96, 576, 1000]), t=st.integers(2, 9),
       b=st.integers(1, 3), plus_one=st.booleans(), dtype=st.sampled_from(["bfloat16", "float32"]),
       block_rows=st.sampled_from([1, 4, 16]))
def test_matches_reference_and_rows_do_not_depend_on_the_row_count(seed, d, t, b, plus_one, dtype, block_rows):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(0, 3, (b, t, d)), dtype)
    w = jnp.asarray(rng.normal(0 if plus_one else 1, 0.1, (d,)), dtype)
    cfg = NormConfig(block_rows=block_rows)
    full = rms_norm(x, w, 1e-6, plus_one, cfg, interpret=True)
    one = rms_norm(x[:, :1], w, 1e-6, plus_one, cfg, interpret=True)
    assert full.shape == x.shape and full.dtype == x.dtype
    np.testing.assert_array_equal(f32(one[:, 0]), f32(full[:, 0]))  # bitwise, T = 1 vs T = t
    ref = rms_norm_reference(x, w, 1e-6, plus_one)
    tol = 2 ** -7 if dtype == "bfloat16" else 1e-5  # one bf16 ulp: the sums' order may differ
    np.testing.assert_allclose(f32(full), f32(ref), rtol=tol, atol=tol)


def test_xla_reduction_order_is_what_the_kernel_avoids():
    """Why the kernel exists: XLA's own norm of a row can change with the row count. If this ever
    stops failing on some backend, the kernel is still correct, only no longer needed there."""
    rng = np.random.default_rng(0)
    differs = 0
    for _ in range(20):
        x = jnp.asarray(rng.normal(0, 3, (2, 5, 576)), jnp.bfloat16)
        mean = jax.jit(lambda x: jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1))
        differs += not np.array_equal(f32(mean(x[:, :1])[:, 0]), f32(mean(x)[:, 0]))
        ker = rms_norm(x, jnp.ones(576, jnp.bfloat16), 1e-6, interpret=True)
        one = rms_norm(x[:, :1], jnp.ones(576, jnp.bfloat16), 1e-6, interpret=True)
        np.testing.assert_array_equal(f32(one[:, 0]), f32(ker[:, 0]))
    print(f"XLA mean differed between 1 and 5 rows in {differs} of 20 draws")


def test_default_configs_keep_a_block_in_registers():
    assert default_norm_config(576) == NormConfig(block_rows=8, num_warps=4)  # padded to 1024
    assert default_norm_config(4096) == NormConfig(block_rows=2, num_warps=8)
    assert default_norm_config(16384) == NormConfig(block_rows=1, num_warps=8)
    assert default_norm_config(64).block_rows == 16


def test_one_row_is_normed_in_place_with_no_pad_or_slice():
    """An AR step's norm (1 row, a width that is no power of two) is the kernel alone: no padded
    copy of x before it, no slice after (each a separate GPU kernel of ~1.5 us)."""
    x = jnp.asarray(np.random.default_rng(1).normal(0, 3, (1, 1, 576)), jnp.bfloat16)
    w = jnp.ones(576, jnp.bfloat16)
    hlo = jax.jit(lambda x, w: rms_norm(x, w, 1e-6, interpret=True)).lower(x, w).as_text()
    jaxpr = str(jax.make_jaxpr(lambda x, w: rms_norm(x, w, 1e-6, interpret=True))(x, w))
    outer = jaxpr.split("pallas_call")[0]  # the ops before the kernel
    assert "pad[" not in outer and "slice[" not in jaxpr.split("name=rms_norm")[-1], jaxpr[:2000]
    assert "rms_norm" in hlo


def test_rows_clamped_at_a_power_of_two_width():
    """A power-of-two width with a row count the block does not divide (an AR step's 1 row of
    4096 under 2-row blocks): rows past the array are clamped but columns are not; every row
    count gives the same bits."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(0, 3, (7, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(1, 0.1, (128,)), jnp.bfloat16)
    cfg = NormConfig(block_rows=4)
    full = f32(rms_norm(x, w, 1e-6, False, cfg, interpret=True))
    for m in (1, 2, 3, 5, 6):
        np.testing.assert_array_equal(f32(rms_norm(x[:m], w, 1e-6, False, cfg, interpret=True)), full[:m])
