"""Probe: swapped-operand Triton skinny GEMMs (benchmarks/swapped_gemm_prototype.py) against XLA and
the engine's kernels (pallas_kernels/skinny_gemm*.py with their tuned configs), on the device.

    python benchmarks/swapped_gemm_probe.py [--shapes 0,1,2] [--tokens 1,16] [--budget-s 480]

Checks first, per config: the swapped bf16 kernel against XLA (float32 accumulation noise) and the
12-bit kernel bitwise against its bf16 twin. Times are device kernel times from a profiler trace
(specjax/profiling.py) of dependent calls inside one jit over weight copies beyond L2, split-K sums
included. TB/s is bf16-equivalent (2 K N bytes / time). Writes $OUT/swapped_gemm_probe.json, prints
a table last.
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
import swapped_gemm_prototype as sp  # noqa: E402
from gemm_probe_log import ProbeLog, per_call  # noqa: E402
from specjax.search.kernel_timer import KernelTimer, random_bits  # noqa: E402

SHAPES = [(8192, 28672), (4096, 14336), (14336, 4096), (4096, 4096), (4096, 128256)]  # (K, N)
CONFIGS = [sp.SwapConfig(128, 128, num_warps=4, num_stages=4), sp.SwapConfig(128, 256, num_warps=4, num_stages=3),
           sp.SwapConfig(64, 256, num_warps=4, num_stages=4), sp.SwapConfig(256, 128, num_warps=8, num_stages=3)]
PROBE = ProbeLog("swapped_gemm_probe")
T0, RES, log, save, row = PROBE.t0, PROBE.res, PROBE.log, PROBE.save, PROBE.row


def time_swapped(k, n, t, cfg, wts, x, ref, label=""):
    """The bf16 twin and the 12-bit kernel of one config on one weight set; returns the 12-bit row."""
    g16 = lambda x, w, cfg=cfg: sp.gemm_bf16(x, w, cfg)  # noqa: E731
    y16 = g16(x, wts[0])
    err = float(jnp.max(jnp.abs(y16 - ref)))
    row(k, n, t, f"swap_bf16{label}_" + cfg.tag, per_call(g16, x, wts), max_err_vs_xla=err)
    encs = [sp.encode_ksplit(w, cfg.block_k) for w in wts]
    base, n_esc = encs[0][4], sum(e[5] for e in encs)
    if any(e[4] != base for e in encs):
        raise ValueError("copies chose different window bases")
    if n_esc and not cfg.escapes:
        raise ValueError("escape-free kernel on weights with escapes")
    g12 = lambda x, e, cfg=cfg: sp.gemm_w12(x, e, base, cfg)  # noqa: E731
    y12 = g12(x, encs[0][:4])
    row(k, n, t, f"swap_w12{label}_" + cfg.tag, per_call(g12, x, [e[:4] for e in encs]),
        bitwise_eq_bf16=bool(jnp.all(y12 == y16)), escape_segments=n_esc,
        escape_fraction=n_esc / (len(wts) * n * k / sp.CHUNK))


def run_shape(k, n, tokens, configs, deadline, timer, esc: bool):
    copies = max(1, int(np.ceil(180e6 / (0.75 * 2 * k * n))))
    wts = [sp.escape_free(jax.random.PRNGKey(k + n + i), (n, k)) for i in range(copies)]
    for t in tokens:
        if time.time() > deadline:
            return
        PROBE.engine_rows(k, n, t, timer)
        x = jax.random.normal(jax.random.PRNGKey(t), (t, k), jnp.float32).astype(jnp.bfloat16)
        ref = sp.reference(x, wts[0])
        for cfg in configs:
            if time.time() > deadline:
                return
            cfg = dataclasses.replace(cfg, split_k=sp.split_for(k, n, cfg))
            try:
                time_swapped(k, n, t, cfg, wts, x, ref)
            except Exception as e:  # noqa: BLE001
                RES["errors"].append(f"{k}x{n} T{t} {cfg.tag}: {e!r}"[:1500])
                log("fail", cfg.tag, repr(e)[:400])
        save()
        b = best("swap_w12_", k, n, t)
        if not esc or b is None or time.time() > deadline:
            continue
        cfg = next(dataclasses.replace(c, split_k=sp.split_for(k, n, c), escapes=True) for c in configs
                   if dataclasses.replace(c, split_k=sp.split_for(k, n, c)).tag == b["kernel"][len("swap_w12_"):])
        try:  # the escape patch on escape-free weights, then on normal weights (real escapes)
            time_swapped(k, n, t, cfg, wts, x, ref, "_noesc")
            normal = [jax.lax.bitcast_convert_type(random_bits(jax.random.PRNGKey(7 + i), (n, k)), jnp.bfloat16)
                      for i in range(copies)]
            time_swapped(k, n, t, cfg, normal, x, sp.reference(x, normal[0]), "_normal")
            del normal
        except Exception as e:  # noqa: BLE001
            RES["errors"].append(f"{k}x{n} T{t} esc {cfg.tag}: {e!r}"[:1500])
            log("fail esc", cfg.tag, repr(e)[:400])
        save()


def best(prefix, k, n, t):
    rows = [r for r in RES["rows"] if r["kernel"].startswith(prefix) and r["shape"] == [k, n] and r["T"] == t
            and (prefix.startswith("engine") or r["kernel"][len(prefix):len(prefix) + 2] in ("n6", "n1", "n2"))]
    return max(rows, key=lambda r: r["tbps"]) if rows else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0,1,2,3,4")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--esc", action="store_true",
                    help="also time the best 12-bit config with the escape patch (no escapes; normal weights)")
    a = ap.parse_args()
    deadline = T0 + a.budget_s
    shapes = [SHAPES[int(i)] for i in a.shapes.split(",")]
    tokens = [int(t) for t in a.tokens.split(",")]
    timer = KernelTimer(method="kernel")
    for k, n in shapes:
        run_shape(k, n, tokens, CONFIGS, deadline, timer, a.esc)
        timer._weights.clear()
    save()
    print("\n== best per shape and T (TB/s bf16-equivalent; ratios vs engine bf16) ==")
    print(f"{'K x N':>12} {'T':>3} {'xla':>6} {'eng16':>6} {'eng12':>6} {'swap16':>7} {'swap12':>7} "
          f"{'s12/e16':>7} {'s12/s16':>7}  configs (swap16 | swap12)")
    for k, n in shapes:
        for t in tokens:
            rs = {p: best(p, k, n, t) for p in ("engine_xla", "engine_bf16", "engine_lh12", "swap_bf16_", "swap_w12_",
                                                "swap_w12_noesc_", "swap_w12_normal_", "swap_bf16_normal_")}
            v = {p: (r["tbps"] if r else float("nan")) for p, r in rs.items()}
            print(f"{k:>5}x{n:<6} {t:>3} {v['engine_xla']:6.2f} {v['engine_bf16']:6.2f} {v['engine_lh12']:6.2f} "
                  f"{v['swap_bf16_']:7.2f} {v['swap_w12_']:7.2f} {v['swap_w12_'] / v['engine_bf16']:7.2f} "
                  f"{v['swap_w12_'] / v['swap_bf16_']:7.2f}  "
                  f"{(rs['swap_bf16_'] or {}).get('kernel', '-')[10:]} | {(rs['swap_w12_'] or {}).get('kernel', '-')[9:]}")
            if rs["swap_w12_normal_"]:
                r = rs["swap_w12_normal_"]
                print(f"{'':>16} escape patch: no escapes {v['swap_w12_noesc_']:.2f}, normal weights "
                      f"{v['swap_w12_normal_']:.2f} ({r['escape_fraction']:.2%} segments; twin "
                      f"{v['swap_bf16_normal_']:.2f}; bitwise {r['bitwise_eq_bf16']})")
    PROBE.print_errors()


if __name__ == "__main__":
    main()
