"""Probe: the FP32-pipe skinny GEMMs (benchmarks/fma_gemm_prototype.py) against XLA and the engine's
kernels (pallas_kernels/skinny_gemm*.py with their tuned configs), on the device.

    python benchmarks/fma_gemm_probe.py [--shapes 0,1,2] [--tokens 1,4,8,16] [--budget-s 300]

Checks first, per config: the FMA bf16 kernel against XLA (float32 accumulation noise), the 12-bit
kernel bitwise against its bf16 twin, and row 0 of a T-row call bitwise against a 1-row call. Times
are device kernel times from a profiler trace (specjax/profiling.py) of dependent calls inside one
jit over weight copies beyond L2, the split partial sums included. TB/s is bf16-equivalent
(2 K N bytes / time). Writes $OUT/fma_gemm_probe.json, prints a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fma_gemm_prototype as fp  # noqa: E402
from gemm_probe_log import ProbeLog, per_call  # noqa: E402
from specjax.search.kernel_timer import KernelTimer  # noqa: E402

SHAPES = [(8192, 28672), (4096, 14336), (14336, 4096), (4096, 4096), (4096, 128256)]  # (K, N)
# (config, target programs for the split)
CONFIGS = [(fp.FmaConfig(128, unroll=4, num_warps=4), 1056), (fp.FmaConfig(128, unroll=8, num_warps=4), 528),
           (fp.FmaConfig(64, unroll=8, num_warps=2), 2112), (fp.FmaConfig(256, unroll=4, num_warps=8), 528)]
PROBE = ProbeLog("fma_gemm_probe")
T0, RES, log, save, row = PROBE.t0, PROBE.res, PROBE.log, PROBE.save, PROBE.row


def run_shape(k, n, tokens, deadline, timer):
    copies = max(1, int(np.ceil(180e6 / (0.75 * 2 * k * n))))
    wts = [fp.escape_free(jax.random.PRNGKey(k + n + i), (k, n)) for i in range(copies)]
    encs = [fp.encode(w) for w in wts]
    base = encs[0][2]
    if any(e[2] != base for e in encs):
        raise ValueError("copies chose different window bases")
    planes = [e[:2] for e in encs]
    for t in tokens:
        if time.time() > deadline:
            return
        PROBE.engine_rows(k, n, t, timer)
        x = jax.random.normal(jax.random.PRNGKey(t), (t, k), jnp.float32).astype(jnp.bfloat16)
        ref = x.astype(jnp.float32) @ wts[0].astype(jnp.float32)
        for cfg, target in CONFIGS:
            if time.time() > deadline:
                return
            cfg = dataclasses.replace(cfg, split_k=fp.split_for(k, n, cfg, target))
            try:
                g16 = lambda x, w, cfg=cfg: fp.gemm_bf16(x, w, cfg)  # noqa: E731
                g12 = lambda x, p, cfg=cfg: fp.gemm_w12(x, p[0], p[1], base, cfg)  # noqa: E731
                y16, y12, y1 = g16(x, wts[0]), g12(x, planes[0]), g16(x[:1], wts[0])
                row(k, n, t, "fma_bf16_" + cfg.tag, per_call(g16, x, wts),
                    max_err_vs_xla=float(jnp.max(jnp.abs(y16 - ref))), row0_eq_t1=bool(jnp.all(y16[0] == y1[0])))
                row(k, n, t, "fma_w12_" + cfg.tag, per_call(g12, x, planes),
                    bitwise_eq_bf16=bool(jnp.all(y12 == y16)))
            except Exception as e:  # noqa: BLE001
                RES["errors"].append(f"{k}x{n} T{t} {cfg.tag}: {e!r}"[:1500])
                log("fail", cfg.tag, repr(e)[:400])
        save()


def best(prefix, k, n, t):
    rows = [r for r in RES["rows"] if r["kernel"].startswith(prefix) and r["shape"] == [k, n] and r["T"] == t]
    return max(rows, key=lambda r: r["tbps"]) if rows else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0,1,2")
    ap.add_argument("--tokens", default="1,4,8,16")
    ap.add_argument("--budget-s", type=float, default=300)
    a = ap.parse_args()
    deadline = T0 + a.budget_s
    shapes = [SHAPES[int(i)] for i in a.shapes.split(",")]
    tokens = [int(t) for t in a.tokens.split(",")]
    timer = KernelTimer(method="kernel")
    for k, n in shapes:
        run_shape(k, n, tokens, deadline, timer)
        timer._weights.clear()
    save()
    print("\n== best per shape and T (TB/s bf16-equivalent; ratios vs the engine's bf16 kernel) ==")
    print(f"{'K x N':>12} {'T':>3} {'xla':>6} {'eng16':>6} {'eng12':>6} {'fma16':>6} {'fma12':>6} "
          f"{'f12/e16':>7} {'f12/f16':>7} {'f16/e16':>7}  checks  configs (fma16 | fma12)")
    for k, n in shapes:
        for t in tokens:
            rs = {p: best(p, k, n, t) for p in ("engine_xla", "engine_bf16", "engine_lh12", "fma_bf16_", "fma_w12_")}
            v = {p: (r["tbps"] if r else float("nan")) for p, r in rs.items()}
            ok = all(r.get("bitwise_eq_bf16", True) and r.get("row0_eq_t1", True)
                     for r in RES["rows"] if r["kernel"].startswith("fma_") and r["shape"] == [k, n] and r["T"] == t)
            print(f"{k:>5}x{n:<6} {t:>3} {v['engine_xla']:6.2f} {v['engine_bf16']:6.2f} {v['engine_lh12']:6.2f} "
                  f"{v['fma_bf16_']:6.2f} {v['fma_w12_']:6.2f} {v['fma_w12_'] / v['engine_bf16']:7.2f} "
                  f"{v['fma_w12_'] / v['fma_bf16_']:7.2f} {v['fma_bf16_'] / v['engine_bf16']:7.2f}  "
                  f"{'exact' if ok else 'DIFF'}  {(rs['fma_bf16_'] or {}).get('kernel', '-')[9:]} | "
                  f"{(rs['fma_w12_'] or {}).get('kernel', '-')[8:]}")
    PROBE.print_errors()


if __name__ == "__main__":
    main()
