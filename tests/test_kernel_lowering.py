"""The kernels lower to Triton IR for CUDA on a CPU-only machine (jax.export cross-lowering), and
that IR passes Triton's op verifiers: CI catches a Pallas construct the GPU path rejects (an
unsupported primitive, a multi-result inline asm, an asm typed `ui32`) without a GPU. Compiling
the IR to PTX, and the numerics, still need the device."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export

from pallas_kernels.skinny_gemm import GemmConfig, prepare_bf16, skinny_gemm
from pallas_kernels.skinny_gemm_lh12 import prepare_lh12, skinny_gemm_lh12
from specjax.weights.lh12 import encode

TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


@pytest.fixture(autouse=True)
def verified_triton_modules(monkeypatch):
    """Run Triton's verifier on every module Pallas builds (XLA would on the device)."""
    from jax._src.pallas.triton import lowering
    lower = lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()  # raises with the op and the source line
        return result
    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lower_and_verify)


def lower_for_cuda(f, *args) -> str:
    exp = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[TRITON])(*args)
    return exp.mlir_module()


@pytest.fixture(scope="module")
def weight():
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.02, (256, 1024)).astype(ml_dtypes.bfloat16)
    w.view(np.uint16)[::37, ::11] = 0  # zeros: escape segments, so the patch path is lowered too
    return w


@pytest.mark.parametrize("cfg", [
    GemmConfig(),
    GemmConfig(block_n=512, escape_lookup="segment", num_stages=2),
    GemmConfig(block_n=256, escape_lookup="masked", decode="prmt", split_k=2),
    GemmConfig(block_n=256, escape_lookup="masked", decode="prmt", one_dot=True),
], ids=str)
def test_lh12_kernel_lowers_for_cuda(weight, cfg):
    p = encode(weight.view(np.uint16))
    assert p.n_escape > 0
    for t in (1, 20, 150):  # 150: three row blocks (ROWS_PER_PROGRAM)
        module = lower_for_cuda(skinny_gemm_lh12, jnp.ones((t, 256), jnp.bfloat16), prepare_lh12(p, cfg))
        assert "skinny_gemm_lh12" in module and "xla.gpu.triton" in module


@pytest.mark.parametrize("block_n", [128, 512])
def test_bf16_kernel_lowers_for_cuda(weight, block_n):
    gw = prepare_bf16(jnp.asarray(weight), GemmConfig(block_n=block_n, split_k=2))
    for t in (3, 150):
        module = lower_for_cuda(skinny_gemm, jnp.ones((t, 256), jnp.bfloat16), gw)
        assert "skinny_gemm_bf16" in module and "xla.gpu.triton" in module


@pytest.mark.parametrize("t", [1, 16])
def test_decode_attention_lowers_for_cuda(t):
    from pallas_kernels.decode_attention import AttentionConfig, decode_attention
    B, S, Hq, Hkv, hd = 1, 256, 8, 2, 64
    q = jnp.ones((B, t, Hq, hd), jnp.bfloat16)
    kv = jnp.ones((B, S, Hkv, hd), jnp.bfloat16)
    mask = jnp.ones((B, t, S), bool)
    f = lambda q, k, v, m, n: decode_attention(q, k, v, m, n, AttentionConfig())
    module = lower_for_cuda(f, q, kv, kv, mask, jnp.array([S], jnp.int32))
    assert "decode_attention" in module and "xla.gpu.triton" in module


@pytest.mark.parametrize("plus_one,width", [(False, 576), (True, 576), (False, 4096)])
def test_rms_norm_lowers_for_cuda(plus_one, width):
    from pallas_kernels.rms_norm import rms_norm
    f = lambda x, w: rms_norm(x, w, 1e-5, plus_one)
    module = lower_for_cuda(f, jnp.ones((2, 5, width), jnp.bfloat16), jnp.ones((width,), jnp.bfloat16))
    assert "rms_norm" in module and "xla.gpu.triton" in module


@pytest.mark.parametrize("n,depth", [(1, 0), (17, 5), (33, 32)])
def test_tree_gdn_lowers_for_cuda(n, depth):
    from pallas_kernels.tree_gdn import TreeGDNConfig, tree_gdn
    B, H, dk, dv = 1, 2, 128, 128
    f32 = jnp.float32
    state = jnp.ones((B, H, dk, dv), f32)
    qk = jnp.ones((B, n, H, dk), f32)
    gb = jnp.ones((B, n, H), f32)
    anc = jnp.ones((B, n, n), bool)
    f = lambda s, q, k, v, g, b, a: tree_gdn(s, q, k, v, g, b, a, depth, TreeGDNConfig())
    module = lower_for_cuda(f, state, qk, qk, jnp.ones((B, n, H, dv), f32), gb, gb, anc)
    assert "tree_gdn" in module and "xla.gpu.triton" in module


@pytest.mark.parametrize("n", [1, 16])
def test_tree_attention_lowers_for_cuda(n):
    from pallas_kernels.tree_attention import tree_attention
    B, S, Hq, Hkv, hd = 1, 256, 9, 3, 64
    q = jnp.ones((B, n, Hq, hd), jnp.bfloat16)
    kv = jnp.ones((B, S, Hkv, hd), jnp.bfloat16)
    anc = jnp.ones((B, n, n), bool)
    depths = jnp.zeros((B, n), jnp.int32)
    f = lambda q, k, v, s, a, d: tree_attention(q, k, v, s, a, d, n - 1)
    module = lower_for_cuda(f, q, kv, kv, jnp.array([100], jnp.int32), anc, depths)
    assert "tree_attention" in module and "xla.gpu.triton" in module


@pytest.mark.parametrize("tree", [False, True])
def test_paged_attention_lowers_for_cuda(tree):
    from pallas_kernels.paged_attention import paged_attention
    R, W, Hq, Hkv, hd, page_size, P = 4, 9, 8, 2, 64, 16, 8
    q = jnp.ones((R, W, Hq, hd), jnp.bfloat16)
    pool = jnp.ones((R * P + 1, page_size, Hkv, hd), jnp.bfloat16)
    pages = jnp.zeros((R, P), jnp.int32)
    qpos = jnp.zeros((R, W), jnp.int32)
    kv_len = jnp.full((R,), 40, jnp.int32)
    if tree:
        f = lambda q, k, v, p, s, n, r, a: paged_attention(q, k, v, p, s, n, root=r, ancestors=a)
        args = (jnp.zeros((R,), jnp.int32), jnp.ones((R, W, W), bool))
    else:
        f = lambda q, k, v, p, s, n: paged_attention(q, k, v, p, s, n)
        args = ()
    module = lower_for_cuda(f, q, pool, pool, pages, qpos, kv_len, *args)
    assert "paged_attention" in module and "xla.gpu.triton" in module
