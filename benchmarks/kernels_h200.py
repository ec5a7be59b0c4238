"""Skinny GEMM kernels on the device: correctness, then read bandwidth, GEMV/skinny-GEMM bandwidth
(XLA bf16 vs ours bf16 vs ours 12-bit) and the Llama-3-8B-shaped decode step.

    python benchmarks/kernels_h200.py --parts bw,gemv,step [--sweep] [--budget-s 480]

Every timing is R dependent calls inside one jit (a `lax.fori_loop` whose carry feeds the next
call), median of several repeats; weights rotate over enough copies to exceed the 60 MB L2.
Bandwidth is bf16-equivalent: 2 * K * N bytes over time, for the 12-bit kernel too (so its
figure over the read bandwidth is its speedup over a perfect bf16 read). Writes
$OUT/kernels_h200.json and prints a short table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pallas_kernels.skinny_gemm import (GemmConfig, default_config, prepare_bf16, skinny_gemm,  # noqa: E402
                                        skinny_gemm_reference)
from pallas_kernels.skinny_gemm_lh12 import prepare_lh12, skinny_gemm_lh12  # noqa: E402
from specjax.search.kernel_timer import looped, random_bits  # noqa: E402
from specjax.search.kernel_timer import median_seconds as timed  # noqa: E402
from specjax.weights.lh12 import encode_jax  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (4096, 128256)]
TOKENS = [1, 4, 16, 64]
L2_BYTES = 60e6
T0 = time.time()
RESULTS: dict = {}
INTERPRET = False  # --smoke: tiny shapes in Pallas interpret mode, to check the script on a CPU


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def save(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_h200.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def clamp_tiny(bits):
    """Weights with |w| < 2^-12 raised to ±2^-12: every exponent lands in one 16-wide window."""
    w = jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)
    w = jnp.where(jnp.abs(w) < 2.0 ** -12, jnp.where(w < 0, -1.0, 1.0) * 2.0 ** -12, w)
    return jax.lax.bitcast_convert_type(w.astype(jnp.bfloat16), jnp.uint16)


# --------------------------------------------------------------------------- read bandwidth

def read_bandwidth() -> dict:
    """Read-only streaming: XLA's column sum and a Pallas read kernel over 4 GiB of bf16."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    rows, cols = 1 << 22, 512
    x = jax.random.normal(jax.random.PRNGKey(0), (rows, cols), jnp.bfloat16)
    nbytes = x.size * 2
    out = {"bytes": nbytes}
    xla = jax.jit(lambda x: jnp.sum(x, axis=0, dtype=jnp.float32))
    out["xla_colsum_TBps"] = nbytes / timed(xla, x) / 1e12
    xla_rows = jax.jit(lambda x: jnp.sum(x, axis=1, dtype=jnp.float32))
    out["xla_rowsum_TBps"] = nbytes / timed(xla_rows, x) / 1e12
    for rb, chunk, nw, ns in [(4096, 64, 8, 3), (8192, 128, 8, 2), (4096, 32, 4, 4), (2048, 64, 4, 3)]:
        def kernel(x_ref, o_ref, rb=rb, chunk=chunk):
            def body(i, acc):
                return acc + x_ref[pl.ds(i * chunk, chunk), :].astype(jnp.float32)
            acc = jax.lax.fori_loop(0, rb // chunk, body, jnp.zeros((chunk, cols), jnp.float32))
            o_ref[...] = jnp.sum(acc, axis=0, keepdims=True)
        f = jax.jit(lambda x, kernel=kernel, rb=rb, nw=nw, ns=ns: pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((rows // rb, cols), jnp.float32),
            grid=(rows // rb,), in_specs=[pl.BlockSpec((rb, cols), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((1, cols), lambda i: (i, 0)),
            compiler_params=plgpu.CompilerParams(num_warps=nw, num_stages=ns))(x))
        try:
            out[f"pallas_read_rb{rb}_c{chunk}_w{nw}_s{ns}_TBps"] = nbytes / timed(f, x) / 1e12
        except Exception as e:  # noqa: BLE001 - record and go on
            out[f"pallas_read_rb{rb}_c{chunk}_w{nw}_error"] = repr(e)[:300]
    # one block per program, no loop: many small programs keep more loads in flight per SM
    for rb, nw in [(32, 4), (64, 4), (128, 8)]:
        def one_block(x_ref, o_ref):
            o_ref[...] = jnp.sum(x_ref[...].astype(jnp.float32), axis=0, keepdims=True)
        f = jax.jit(lambda x, rb=rb, nw=nw: pl.pallas_call(
            one_block, out_shape=jax.ShapeDtypeStruct((rows // rb, cols), jnp.float32),
            grid=(rows // rb,), in_specs=[pl.BlockSpec((rb, cols), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((1, cols), lambda i: (i, 0)),
            compiler_params=plgpu.CompilerParams(num_warps=nw, num_stages=1))(x))
        try:
            out[f"pallas_read_block{rb}_w{nw}_TBps"] = nbytes / timed(f, x) / 1e12
        except Exception as e:  # noqa: BLE001
            out[f"pallas_read_block{rb}_w{nw}_error"] = repr(e)[:300]
    out.update(rows_gemv_probes())
    out["read_TBps"] = max(v for k, v in out.items() if k.endswith("_TBps"))
    log("read bandwidth", {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()})
    return out


def rows_gemv_probes() -> dict:
    """The read-only kernel that streamed fastest on 2026-12-02 (shared/device/gemv_probe3.py): a
    GEMV over W [N, K] rows, bn rows per program, elementwise products summed along K, no tensor
    cores; one weight of 470 MB (8x L2), so every call streams it from HBM."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    out = {}
    for n, k in [(28672, 8192), (8192, 28672)]:
        w = jax.random.normal(jax.random.PRNGKey(1), (n, k), jnp.bfloat16)
        x = jax.random.normal(jax.random.PRNGKey(2), (1, k), jnp.bfloat16)
        for bn, bk, nw, ns in [(4, 4096, 8, 2), (8, 2048, 8, 2), (8, 4096, 8, 1), (2, 4096, 4, 2),
                               (4, 4096, 8, 3), (16, 1024, 8, 3)]:
            def rows(x_ref, w_ref, o_ref, bk=bk, bn=bn):
                def body(i, acc):
                    xs = x_ref[0, pl.ds(i * bk, bk)].astype(jnp.float32)
                    return acc + jnp.sum(w_ref[:, pl.ds(i * bk, bk)].astype(jnp.float32) * xs[None, :], axis=1)
                o_ref[0, :] = jax.lax.fori_loop(0, k // bk, body, jnp.zeros((bn,), jnp.float32))
            call = pl.pallas_call(
                rows, out_shape=jax.ShapeDtypeStruct((1, n), jnp.float32), grid=(n // bn,),
                in_specs=[pl.BlockSpec((1, k), lambda j: (0, 0)), pl.BlockSpec((bn, k), lambda j: (j, 0))],
                out_specs=pl.BlockSpec((1, bn), lambda j: (0, j)),
                compiler_params=plgpu.CompilerParams(num_warps=nw, num_stages=ns))
            name = f"pallas_rows_gemv_{n}x{k}_bn{bn}_bk{bk}_w{nw}_s{ns}"
            try:
                out[name + "_TBps"] = w.size * 2 / (timed(looped(lambda x, w, call=call: call(x, w), 20),
                                                          x, [w]) / 20) / 1e12
            except Exception as e:  # noqa: BLE001
                out[name + "_error"] = repr(e)[:300]
    return out


# --------------------------------------------------------------------------- attention

ATTN_CONFIGS = [dict(block_s=64, split_s=256), dict(block_s=64, split_s=128), dict(block_s=32, split_s=128),
                dict(block_s=128, split_s=256), dict(block_s=64, split_s=256, num_warps=8),
                dict(block_s=64, split_s=512)]


def attention_part() -> dict:
    """One layer's attention at the 8B shape (32 query heads, 8 KV heads, head_dim 128, 1k context):
    XLA (the model's einsum + softmax) vs the Pallas kernel per config; error against the
    reference and T-invariance (row 0 of T = 16 equals T = 1) checked first."""
    from pallas_kernels.decode_attention import (AttentionConfig, decode_attention,
                                                 decode_attention_reference)
    from specjax.models.config import ModelConfig
    from specjax.models.transformer import _attention, causal_slot_mask
    cfg = ModelConfig(**LLAMA3_8B)
    B, S, reps = 1, CONTEXT + 64, 32
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    kc = jax.random.normal(keys[0], (B, S, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    vc = jax.random.normal(keys[1], (B, S, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    start = jnp.array([CONTEXT], jnp.int32)
    out = {"shape": dict(heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, slots=S)}

    def loop(attn, t):
        mask = causal_slot_mask(start, t, S)

        def run(q, kc, vc):
            def body(_, q):
                y = attn(q, kc, vc, mask).reshape(q.shape)
                return q + (y * 0.0).astype(q.dtype)
            return jax.lax.fori_loop(0, reps, body, q)
        return jax.jit(run)

    for t in STEP_TOKENS:
        q = jax.random.normal(keys[2], (B, t, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
        row = {"xla_us": timed(loop(lambda q, k, v, m: _attention(cfg, q, k, v, m), t), q, kc, vc) / reps * 1e6}
        mask = causal_slot_mask(start, t, S)
        ref = decode_attention_reference(q, kc, vc, mask).astype(jnp.float32)
        for d in ATTN_CONFIGS:
            c = AttentionConfig(**d)
            name = f"bs{c.block_s}_sp{c.split_s}_w{c.num_warps}"
            try:
                y = decode_attention(q, kc, vc, mask, start + t, c, INTERPRET).astype(jnp.float32)
                row[name + "_maxerr"] = float(jnp.max(jnp.abs(y - ref)))
                if t > 1:
                    y1 = decode_attention(q[:, :1], kc, vc, causal_slot_mask(start, 1, S), start + 1, c, INTERPRET)
                    row[name + "_row0_equals_T1"] = bool(jnp.all(y1[:, 0] == y[:, 0].astype(y1.dtype)))
                row[name + "_us"] = timed(loop(lambda q, k, v, m, c=c, t=t: decode_attention(
                    q, k, v, m, start + t, c, INTERPRET), t), q, kc, vc) / reps * 1e6
            except Exception as e:  # noqa: BLE001
                row[name + "_error"] = repr(e)[:300]
        out[f"T{t}"] = row
        log("attention", t, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    return out


# --------------------------------------------------------------------------- GEMV

def check_kernels(shape, cfg16: GemmConfig, cfg12: GemmConfig, packed, bits) -> dict:
    """Against the reference (relative error), bf16 vs 12-bit bitwise (each with its own speed
    settings, one numerics), and T-invariance bitwise."""
    k, _ = shape
    w = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    x = jax.random.normal(jax.random.PRNGKey(7), (16, k), jnp.bfloat16)
    y16 = skinny_gemm(x, prepare_bf16(w, cfg16, INTERPRET))
    y12 = skinny_gemm_lh12(x, prepare_lh12(packed, cfg12, INTERPRET))
    y1 = skinny_gemm(x[3:4], prepare_bf16(w, cfg16, INTERPRET))
    ref = skinny_gemm_reference(x, w)
    rel = float(jnp.linalg.norm(y16 - ref) / jnp.linalg.norm(ref))
    return {"rel_err_vs_reference": rel,
            "bf16_equals_lh12_bitwise": bool(jnp.array_equal(y16, y12)),
            "row_T1_equals_row_T16_bitwise": bool(jnp.array_equal(y1[0], y16[3])),
            "finite": bool(jnp.all(jnp.isfinite(y12)))}


def speed_candidates(shape, fmt_: str, sweep: bool, ranked: list) -> list[GemmConfig]:
    """Configs sharing the shape's numerics (block_k, split_k: default_config), varying only the
    speed settings of one format; settings that won on earlier shapes first."""
    base = default_config(shape)
    if fmt_ == "bf16":
        space = [dict(block_n=bn, num_warps=nw, num_stages=ns)
                 for bn in (256, 512, 128, 1024) for nw, ns in ((4, 3), (4, 4), (8, 3), (8, 4))]
    else:
        # 2026-12-03 run 1: block_n 512 spilled (0.6-0.8 TB/s), 8 warps lost, lookups tied
        space = [dict(block_n=bn, num_warps=4, num_stages=ns, escape_lookup="masked", decode=dec,
                      one_dot=one)
                 for one in (True, False) for dec in ("prmt", "swar") for bn in (256, 128) for ns in (3, 4)]
        space += [dict(block_n=256, num_warps=4, num_stages=3, escape_lookup=lk, decode=dec, one_dot=one)
                  for lk in ("segment", "superword") for one in (True, False) for dec in ("prmt", "swar")]
    space = [dataclasses.replace(base, **d) for d in space]
    if not sweep:
        return [base if fmt_ == "bf16" else dataclasses.replace(base, escape_lookup="masked", decode="prmt")]
    first = [dataclasses.replace(base, **{f: getattr(c, f) for f in
                                          ("block_n", "num_warps", "num_stages", "escape_lookup",
                                           "decode", "one_dot")})
             for c in ranked]
    return list(dict.fromkeys(first + space))


WINS: dict[str, list] = {"bf16": [], "lh12": []}  # best speed settings per shape, in shape order
BEST: dict = {}  # (shape, format) -> the sweep's winner, for the decode step
SWEEP_FORMATS = ("bf16", "lh12")


def sweep_format(fmt_, shape, weights_of, bw, sweep: bool, deadline: float, entry) -> GemmConfig:
    """Time the candidates at T = 1 until the deadline; the fastest wins."""
    tried = {}
    cands = speed_candidates(shape, fmt_, sweep, WINS[fmt_])
    if fmt_ not in SWEEP_FORMATS and (shape, fmt_) in BEST:  # an earlier run's winner stands
        cands = [BEST[(shape, fmt_)]]
    for cfg in cands:
        if tried and time.time() > deadline:
            break
        try:
            tried[cfg] = bw(skinny_gemm if fmt_ == "bf16" else skinny_gemm_lh12, weights_of(cfg), 1)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result too
            entry.setdefault("errors", []).append(f"{fmt_} {cfg}: {e!r}"[:400])
            log(fmt_, "error", cfg, repr(e)[:200])
    entry[f"sweep_T1_{fmt_}"] = {str(c): v for c, v in tried.items()}
    if not tried:
        raise RuntimeError(f"no {fmt_} config ran on {shape}")
    best = max(tried, key=tried.get)
    WINS[fmt_].insert(0, best)
    return best


def gemv(sweep: bool, budget_s: float) -> dict:
    res = dict(RESULTS.get("gemv", {}))
    start = time.time()
    for n_shape, shape in enumerate(SHAPES):
        k, n = shape
        key = f"{k}x{n}"
        nbytes = 2 * k * n
        copies = max(1, int(np.ceil(3 * L2_BYTES / (0.75 * nbytes))))
        keys = jax.random.split(jax.random.PRNGKey(k + n), copies)
        bits = [random_bits(kk, shape) for kk in keys]
        packed = [encode_jax(b) for b in bits]
        w16 = [jax.lax.bitcast_convert_type(b, jnp.bfloat16) for b in bits]
        reps = max(2, int(2e-3 / (nbytes / 4e12 * copies)))
        entry = {"copies": copies, "reps": reps, "escape_segments": [p.n_escape for p in packed],
                 "lh12_bits_per_weight": packed[0].bits_per_weight}

        def bw(gemm, weights, t):
            x = jax.random.normal(jax.random.PRNGKey(t), (t, k), jnp.bfloat16)
            return nbytes * copies * reps / timed(looped(gemm, reps), x, weights) / 1e12

        xla = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
        earlier = res.get(key, {}).get("xla_TBps")  # from --configs-from: same harness, same day
        entry["xla_TBps"] = earlier or {t: bw(xla, w16, t) for t in TOKENS}
        if earlier:
            entry["xla_from_earlier_run"] = True
        share = (budget_s - (start - T0) - (time.time() - start)) / (len(SHAPES) - n_shape) / 2
        try:
            best16 = sweep_format("bf16", shape, lambda c: [prepare_bf16(w, c, INTERPRET) for w in w16],
                                  bw, sweep, time.time() + share, entry)
            best12 = sweep_format("lh12", shape, lambda c: [prepare_lh12(p, c, INTERPRET) for p in packed],
                                  bw, sweep, time.time() + share, entry)
        except RuntimeError as e:
            entry.setdefault("errors", []).append(str(e))
            res[key] = entry
            RESULTS["gemv"] = res
            save(Path(os.environ.get("OUT", ".")))
            continue
        entry["config_lh12"], entry["config_bf16"] = str(best12), str(best16)
        BEST[(shape, "bf16")], BEST[(shape, "lh12")] = best16, best12
        entry["config_dicts"] = {"bf16": dataclasses.asdict(best16), "lh12": dataclasses.asdict(best12)}
        entry["check"] = check_kernels(shape, best16, best12, packed[0], bits[0])
        lw = [prepare_lh12(p, best12, INTERPRET) for p in packed]
        bw16 = [prepare_bf16(w, best16, INTERPRET) for w in w16]
        entry["ours_bf16_TBps"] = {t: bw(skinny_gemm, bw16, t) for t in TOKENS}
        entry["ours_lh12_TBps"] = {t: bw(skinny_gemm_lh12, lw, t) for t in TOKENS}
        # the same with no escape segment anywhere (|w| clamped to >= 2^-12): the patch path's cost
        clean = [encode_jax(clamp_tiny(b)) for b in bits]
        entry["lh12_no_escape_segments"] = sum(p.n_escape for p in clean)
        entry["ours_lh12_no_escapes_TBps"] = {t: bw(skinny_gemm_lh12, [prepare_lh12(p, best12, INTERPRET)
                                                                       for p in clean], t) for t in (1, 16)}
        res[key] = entry
        log(key, "xla", fmt(entry["xla_TBps"]), "bf16", fmt(entry["ours_bf16_TBps"]),
            "lh12", fmt(entry["ours_lh12_TBps"]), entry["check"], best16, best12)
        RESULTS["gemv"] = res
        save(Path(os.environ.get("OUT", ".")))
    return res


# --------------------------------------------------------------------------- decode step

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                 num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                 max_position_embeddings=8192, dtype="bfloat16")
STEP_TOKENS = [1, 16, 64]
CONTEXT = 1024


def step_bytes(cfg, params) -> dict:
    """Bytes one step must read: weights (per format) + the KV cache of the context."""
    from specjax.models.linear import is_kernel_weight
    kv = 2 * cfg.num_layers * CONTEXT * cfg.kv_size * 2
    w = 0
    for leaf in jax.tree.leaves(params, is_leaf=is_kernel_weight):
        if is_kernel_weight(leaf):
            w += leaf.nbytes if hasattr(leaf, "tile_escapes") else leaf.w.size * 2
        else:
            w += leaf.size * leaf.dtype.itemsize
    w -= params.embed.size * 2  # the embedding is gathered (T rows), not streamed
    return {"weights": w, "kv": kv, "total": w + kv}


def time_steps(params, cfg, t: int, reps: int = 10) -> float:
    """Seconds per verify/decode step of T tokens at a 1k context, R dependent steps in one jit."""
    from specjax.models.kv_cache import init_cache
    from specjax.models.transformer import forward, lm_logits
    cache = init_cache(cfg, 1, CONTEXT + 64)
    start = jnp.array([CONTEXT], jnp.int32)
    pos = CONTEXT + jnp.arange(t, dtype=jnp.int32)[None, :]

    @jax.jit
    def run(params, cache, tokens):
        def body(_, carry):
            cache, tokens = carry
            hidden, cache = forward(params, cfg, tokens, pos, cache, start)
            return cache, jnp.argmax(lm_logits(params, hidden), axis=-1).astype(jnp.int32)
        return jax.lax.fori_loop(0, reps, body, (cache, tokens))[1]

    tokens = jnp.zeros((1, t), jnp.int32) + 7
    return timed(run, params, cache, tokens, repeats=3) / reps


def decode_step() -> dict:
    from specjax.models.config import ModelConfig
    from specjax.models.kernel_params import prepare_kernel_params
    from specjax.models.params import init_random_params
    cfg = ModelConfig(**LLAMA3_8B)
    params = init_random_params(cfg, jax.random.PRNGKey(0))
    read = RESULTS.get("read_bandwidth", {}).get("read_TBps", 4.07) * 1e12
    variants = {"xla": params}
    configs = {(tuple(s), f): c for (s, f), c in BEST.items()}  # the GEMV sweep's winners
    variants["ours_bf16"], _ = prepare_kernel_params(params, cfg, interpret=INTERPRET, configs=configs)
    lh12, report = prepare_kernel_params(params, cfg, {"attn": "lh12", "mlp": "lh12", "head": "lh12"},
                                         interpret=INTERPRET, configs=configs)
    variants["ours_lh12"] = lh12
    # our GEMMs with XLA's attention: what the fused attention kernel adds or saves
    variants["ours_bf16_xla_attention"] = dataclasses.replace(variants["ours_bf16"], attention="xla")
    out = {"config": LLAMA3_8B, "context": CONTEXT, "read_TBps": read / 1e12,
           "lh12_kept_bf16": [r.name for r in report if r.format != "lh12"],
           "configs": {f"{s[0]}x{s[1]} {f}": str(c) for (s, f), c in configs.items()}}
    for name, p in variants.items():
        b = step_bytes(cfg, p)
        row = {"bytes": b, "floor_ms": b["total"] / read * 1e3}
        for t in STEP_TOKENS:
            try:
                row[f"T{t}_ms"] = time_steps(p, cfg, t) * 1e3
            except Exception as e:  # noqa: BLE001
                row[f"T{t}_error"] = repr(e)[:400]
        out[name] = row
        log("step", name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
        RESULTS["step"] = out
        save(Path(os.environ.get("OUT", ".")))
    # greedy tokens of a short AR run: the 12-bit target must give exactly the bf16 target's
    x = jnp.arange(16, dtype=jnp.int32)[None, :] + 100
    ids = {}
    for name in ("ours_bf16", "ours_lh12"):
        from specjax.models.kv_cache import init_cache
        from specjax.models.transformer import forward, lm_logits
        cache = init_cache(cfg, 1, 64)
        hidden, _ = forward(variants[name], cfg, x, jnp.arange(16)[None, :], cache, jnp.array([0]))
        ids[name] = np.asarray(jnp.argmax(lm_logits(variants[name], hidden), -1)).tolist()
        logits = np.asarray(lm_logits(variants[name], hidden))
        ids[name + "_logits_sum"] = float(np.sum(logits))
    out["lh12_logits_equal_bf16"] = ids["ours_bf16_logits_sum"] == ids["ours_lh12_logits_sum"] and \
        ids["ours_bf16"] == ids["ours_lh12"]
    return out


def fmt(d):
    return " ".join(f"{v:.2f}" for v in d.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="bw,gemv")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU check)")
    ap.add_argument("--configs-from", help="an earlier run's kernels_h200.json: its GEMV winners "
                    "configure the step (and its figures are kept in this run's JSON)")
    ap.add_argument("--sweep-formats", default="bf16,lh12",
                    help="formats to sweep; the others keep --configs-from's winners where it has them")
    ap.add_argument("--shapes", help="GEMV shapes to run, e.g. 4096x6144,4096x28672 (default: the five)")
    args = ap.parse_args()
    if args.smoke:
        global INTERPRET, SHAPES, TOKENS, L2_BYTES
        INTERPRET, SHAPES, TOKENS, L2_BYTES = True, [(256, 1024)], [1, 16], 1e6
        LLAMA3_8B.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=32)
    out = Path(os.environ.get("OUT", "."))
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001
        commit = "unknown"
    RESULTS["meta"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "commit": commit, "jax": jax.__version__,
                       "device": jax.devices()[0].device_kind}
    parts = args.parts.split(",")
    global SWEEP_FORMATS
    SWEEP_FORMATS = tuple(args.sweep_formats.split(","))
    if args.shapes:
        SHAPES[:] = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.configs_from:
        earlier = json.loads(Path(args.configs_from).read_text())
        for key in ("read_bandwidth", "gemv"):
            if key in earlier:
                RESULTS[key] = earlier[key]
        for key, e in earlier.get("gemv", {}).items():
            if "config_dicts" in e:
                shape = tuple(int(v) for v in key.split("x"))
                for f, d in e["config_dicts"].items():
                    BEST[(shape, f)] = GemmConfig(**d)
                    WINS[f].append(BEST[(shape, f)])
    if "bw" in parts:
        RESULTS["read_bandwidth"] = read_bandwidth()
        save(out)
    if "gemv" in parts:
        RESULTS["gemv"] = {**RESULTS.get("gemv", {}), **gemv(args.sweep, args.budget_s)}
    if "attn" in parts:
        RESULTS["attention"] = attention_part()
        save(out)
    if "step" in parts:
        RESULTS["step"] = decode_step()
    save(out)
    read = RESULTS.get("read_bandwidth", {}).get("read_TBps", 4.07)
    print(f"\nread bandwidth {read:.2f} TB/s; GEMV effective TB/s (bf16-equivalent) at T = {TOKENS}")
    print(f"{'shape':>12} {'XLA bf16':>24} {'ours bf16':>24} {'ours 12-bit':>24} {'12/16 @T<=16':>12}")
    for key, e in RESULTS.get("gemv", {}).items():
        if "ours_lh12_TBps" not in e:
            print(f"{key:>12} errors: {e.get('errors', ['?'])[:1]}")
            continue
        at = lambda d, t: d[t] if t in d else d[str(t)]  # JSON from --configs-from has str keys
        r = min(at(e["ours_lh12_TBps"], t) / at(e["ours_bf16_TBps"], t) for t in (1, 4, 16)
                if t in e["ours_bf16_TBps"] or str(t) in e["ours_bf16_TBps"])
        print(f"{key:>12} {fmt(e['xla_TBps']):>24} {fmt(e['ours_bf16_TBps']):>24} "
              f"{fmt(e['ours_lh12_TBps']):>24} {r:>12.2f}")
    attn = RESULTS.get("attention")
    if attn:
        print("\nattention per layer, us (XLA | best Pallas config)")
        for t in STEP_TOKENS:
            row = attn.get(f"T{t}", {})
            ours = {k[:-3]: v for k, v in row.items() if k.endswith("_us") and k != "xla_us"}
            best = min(ours, key=ours.get) if ours else None
            print(f"T={t:>3} {row.get('xla_us', float('nan')):8.1f} | "
                  f"{ours.get(best, float('nan')):8.1f} {best}")
    step = RESULTS.get("step")
    if step:
        print(f"\n8B-shaped step, batch 1, {CONTEXT} context: ms (floor = bytes / read bandwidth)")
        for name in ("xla", "ours_bf16_xla_attention", "ours_bf16", "ours_lh12"):
            row = step.get(name, {})
            ts = " ".join(f"T{t}={row.get(f'T{t}_ms', float('nan')):.3f}" for t in STEP_TOKENS)
            print(f"{name:>24} floor={row.get('floor_ms', float('nan')):.3f} {ts}")
        print("12-bit logits equal bf16:", step.get("lh12_logits_equal_bf16"))


if __name__ == "__main__":
    main()
