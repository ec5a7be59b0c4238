"""Prototype Mosaic GPU skinny GEMMs (device probe only, not wired into the engine): bf16 and
escape-free 12-bit weights decoded in registers; `ws` = one warp-specialized pipeline per item,
`stream` = one pipeline per CTA across its items. Measured by benchmarks/mosaic_gemm_probe.py."""
import functools
import jax, jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

TM = 64

def encode12(wt):
    """bf16 [N, K] with every exp>>1 in [base, base+7] -> (lo uint8, code int4, base)."""
    u = lax.bitcast_convert_type(wt, jnp.uint16).astype(jnp.int32)
    hi = u >> 8
    e2 = hi & 0x7F
    base = int(jnp.min(e2))
    assert int(jnp.max(e2)) - base <= 7, "escape-free prototype"
    code = ((hi >> 7) << 3) | (e2 - base)
    code = jnp.where(code >= 8, code - 16, code).astype(jnp.int4)
    return (u & 0xFF).astype(jnp.uint8), code, base


# ---- v2: persistent, warp-specialized (1 memory WG + 2 compute WGs, 64 rows each) ----
def _ws_call(body_fn, in_arrays, n, k, tp, tk, splits, stages, wait, num_sms):
    cta_m = 2 * TM
    m_iters = n // cta_m
    ks = k // splits
    items = m_iters * splits

    def kernel(*refs):
        *in_gmem, xt_gmem, out_gmem, out_smem = refs

        def get_pipeline(body, ctx):
            specs = [plgpu.BlockSpec((cta_m, tk), lambda kk: (0, kk), memory_space=plgpu.SMEM) for _ in in_gmem]
            specs.append(plgpu.BlockSpec((tk, tp), lambda kk: (kk, 0), memory_space=plgpu.SMEM))
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(ks // tk,), memory_registers=40, in_specs=specs, wg_axis="wg",
                num_compute_wgs=2, max_concurrent_steps=stages, compute_context=ctx)

        ignore = lambda *_, **__: None
        def first_slices(mi, si):
            return [g.at[pl.ds(mi * cta_m, cta_m), pl.ds(si * ks, ks)] for g in in_gmem] + \
                   [xt_gmem.at[pl.ds(si * ks, ks), :]]

        @functools.partial(pl.run_scoped,
                           allocs=get_pipeline(ignore, ignore).get_allocations(*first_slices(0, 0)),
                           collective_axes="wg")
        def _scope(allocs):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((items,), collective_axes="sm")
            def _items(info):
                (lin,) = info.index
                mi = lin // splits
                si = lin % splits

                def ctx(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((TM, tp), jnp.float32))
                    def _acc(acc_ref):
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        out_smem[wg] = acc
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[si, pl.ds(mi * cta_m + wg * TM, TM)])

                def body(_, *refs):
                    *w_smems, x_smem, acc_ref = refs
                    body_fn(acc_ref, [w.at[pl.ds(wg * TM, TM)] for w in w_smems], x_smem)
                    plgpu.wgmma_wait(wait)
                    return acc_ref

                get_pipeline(body, ctx)(*first_slices(mi, si), allocations=allocs)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((splits, n, tp), jnp.float32),
                        grid=(num_sms,), grid_names=("sm",), num_threads=3, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                        scratch_types=[plgpu.SMEM((2, TM, tp), jnp.float32)])


def _pad_t(x):
    t = x.shape[0]
    tp = max(16, -(-t // 8) * 8)
    return jnp.pad(x, ((0, tp - t), (0, 0))).T, tp


def gemm_ws_bf16(wt, x, *, tk=128, splits=1, stages=6, wait=0, num_sms=132):
    n, k = wt.shape; t = x.shape[0]
    xt, tp = _pad_t(x)
    def body(acc_ref, w_smems, x_smem):
        plgpu.wgmma(acc_ref, w_smems[0], x_smem)
    return _ws_call(body, [wt], n, k, tp, tk, splits, stages, wait, num_sms)(wt, xt).sum(0)[:, :t].T


def gemm_ws_12(lo, code, base, x, *, tk=128, splits=1, stages=6, wait=0, num_sms=132):
    n, k = lo.shape; t = x.shape[0]
    xt, tp = _pad_t(x)
    def body(acc_ref, w_smems, x_smem):
        lo_s, code_s = w_smems
        c = code_s[...].astype(jnp.int16)
        l = lo_s[...].astype(jnp.int16)
        h = ((c & 7) + base) | ((c & 8) << 4)
        a = lax.bitcast_convert_type((h << 8) | l, jnp.bfloat16)
        plgpu.wgmma(acc_ref, a, x_smem)
    return _ws_call(body, [lo, code], n, k, tp, tk, splits, stages, wait, num_sms)(lo, code, xt).sum(0)[:, :t].T


# ---- v3: one continuous pipeline per CTA over all its (row tile, K split) items ----
def _tiled(shape, dtype):
    """TMA tiling + swizzle for an SMEM block whose minor dimension is shape[1] elements."""
    bits = jnp.dtype(dtype).itemsize * 8 if dtype != jnp.int4 else 4
    swz = plgpu.find_swizzle(shape[1] * bits)
    return (plgpu.TilingTransform((8, swz * 8 // bits)), plgpu.SwizzleTransform(swz))


def _stream_call(body_fn, in_arrays, n, k, tp, tk, splits, stages, num_sms, swizzle=False):
    """CTA c owns items c, c + S, c + 2S, ... (item = row tile * splits + K split); its pipeline runs
    over (item slot, k step) without a restart, so TMA keeps streaming across item boundaries.
    Slots past the last item repeat it (same values written twice)."""
    cta_m = 2 * TM
    m_iters = n // cta_m
    ks = k // splits
    kps = ks // tk
    items = m_iters * splits
    slots = -(-items // num_sms)

    def item_of(slot):
        return jnp.minimum(lax.axis_index("sm") + num_sms * slot, items - 1)

    def kernel(*refs):
        *in_gmem, xt_gmem, out_gmem, out_smem = refs

        def w_map(slot, kk):
            it = item_of(slot)
            return it // splits, (it % splits) * kps + kk

        def x_map(slot, kk):
            it = item_of(slot)
            return (it % splits) * kps + kk, 0

        def get_pipeline(body, ctx):
            tr = (lambda shape, dt: _tiled(shape, dt)) if swizzle else (lambda shape, dt: ())
            specs = [plgpu.BlockSpec((cta_m, tk), w_map, memory_space=plgpu.SMEM, transforms=tr((cta_m, tk), a.dtype))
                     for a in in_arrays]
            specs.append(plgpu.BlockSpec((tk, tp), x_map, memory_space=plgpu.SMEM, transforms=()))
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(slots, kps), memory_registers=40, in_specs=specs, wg_axis="wg",
                num_compute_wgs=2, max_concurrent_steps=stages, compute_context=ctx)

        wg = lax.axis_index("wg")

        def ctx(eval_pipeline):
            eval_pipeline(jnp.zeros((TM, tp), jnp.float32))

        def body(idx, *refs):
            *w_smems, x_smem, acc = refs
            slot, kk = idx
            a = body_fn([w.at[pl.ds(wg * TM, TM)] for w in w_smems])

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, a, x_smem)
            acc = pl.run_state(mma)(plgpu.ACC.init(acc))
            last = kk == kps - 1

            @pl.when(last)
            def _():
                it = item_of(slot)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                out_smem[wg] = acc
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    out_smem.at[wg], out_gmem.at[it % splits, pl.ds((it // splits) * cta_m + wg * TM, TM)])
            return lax.cond(last, lambda a: jnp.zeros_like(a), lambda a: a, acc)

        get_pipeline(body, ctx)(*in_gmem, xt_gmem)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((splits, n, tp), jnp.float32),
                        grid=(num_sms,), grid_names=("sm",), num_threads=3, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                        scratch_types=[plgpu.SMEM((2, TM, tp), jnp.float32)])


def gemm_stream_bf16(wt, x, *, tk=128, splits=1, stages=4, num_sms=132, swizzle=False):
    n, k = wt.shape; t = x.shape[0]
    xt, tp = _pad_t(x)
    body = lambda w_smems: w_smems[0]
    return _stream_call(body, [wt], n, k, tp, tk, splits, stages, num_sms, swizzle)(wt, xt).sum(0)[:, :t].T


def gemm_stream_12(lo, code, base, x, *, tk=128, splits=1, stages=4, num_sms=132, swizzle=False):
    n, k = lo.shape; t = x.shape[0]
    xt, tp = _pad_t(x)
    def body(w_smems):
        lo_s, code_s = w_smems
        c = code_s[...].astype(jnp.int16)
        l = lo_s[...].astype(jnp.int16)
        h = ((c & 7) + base) | ((c & 8) << 4)
        return lax.bitcast_convert_type((h << 8) | l, jnp.bfloat16)
    return _stream_call(body, [lo, code], n, k, tp, tk, splits, stages, num_sms, swizzle)(lo, code, xt).sum(0)[:, :t].T
