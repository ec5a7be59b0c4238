"""Where the time goes on the device: each kernel's own time (CUPTI, read back through
`jax.profiler`) against the wall time of the harnesses we time with, for the read probe, the
skinny GEMMs and the Llama-3-8B-shaped decode step.

    python benchmarks/timing_h200.py [--parts read,gemv,step,flags] [--smoke]

Why: every read-only kernel timed as dependent calls in a `lax.fori_loop` (one call per loop
iteration) has topped out at 3.50 TB/s on the H200, against 4.07 from a do_bench harness. If the
loop itself costs ~15-20 us per iteration, the kernels are faster than our tables say and the
step's missing time is between kernels, not in them. Three timings of one kernel settle it:
  fori      one call per `fori_loop` iteration (the harness of kernels_h200.py)
  unrolled  the same calls as one straight-line jit (no loop between them)
  kernel    the kernels' own durations from the profiler (no launch gaps at all)
The step is timed as wall per step and split into kernel time by kind plus the gaps between;
`flags` reruns the step in subprocesses under XLA command-buffer (CUDA graph) settings.
Writes $OUT/timing_h200.json and prints a short table last.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pallas_kernels.skinny_gemm import prepare_bf16, skinny_gemm  # noqa: E402
from pallas_kernels.skinny_gemm_lh12 import (natural_order, pack_for_kernel, prepare_lh12,  # noqa: E402
                                             skinny_gemm_lh12)
from specjax.profiling import by_name, device_kernel_events  # noqa: E402
from specjax.provenance import code_commit  # noqa: E402
from specjax.search.kernel_timer import looped, random_bits  # noqa: E402
from specjax.search.kernel_timer import median_seconds as timed  # noqa: E402
from specjax.search.kernel_tuner import tuned_config  # noqa: E402
from specjax.rounding import exact_jit  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672), (4096, 128256)]
TOKENS = [1, 16]
L2_BYTES = 60e6
CALLS = 24  # calls per unrolled program
T0 = time.time()
RESULTS: dict = {}
INTERPRET = False
FLAG_SETS = {  # XLA_FLAGS per `flags` subprocess; "" is the default the other parts ran under
    "default": "",
    "no_command_buffer": "--xla_gpu_enable_command_buffer=",
    "graphs_all": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL "
                  "--xla_gpu_graph_min_graph_size=1",
}
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                 num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                 max_position_embeddings=8192, dtype="bfloat16")
CONTEXT = 1024
STEP_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)]  # the 8B step's GEMMs
DEVICE = None  # tile cache to read (memory_store/kernels/<device>.json); None: this device's
KERNEL_ONLY = False  # --timers kernel: skip the fori and unrolled wall-clock harnesses
FINISH_BY_S = float("inf")  # start no new measurement after this many seconds
STEP_TOKENS = (1, 16, 64)  # --step-tokens


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def save():
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "timing_h200.json").write_text(json.dumps(RESULTS, indent=1, default=str))


# --------------------------------------------------------------------------- profiler

KINDS = [  # (kind, regex on the kernel name), first match wins
    ("gemm_ours", r"skinny_gemm"),
    ("attention_ours", r"decode_attention|paged_attention"),
    ("norm_ours", r"rms_norm"),
    ("gemm_xla", r"gemm|gemv|xmma|cutlass|sm90|cublas|dot|matmul"),
    ("memcpy", r"[Mm]emcpy|[Mm]emset"),
    ("other", r""),
]


def kind_of(name: str) -> str:
    return next(k for k, rx in KINDS if re.search(rx, name))


# --------------------------------------------------------------------------- read probe

def read_part() -> dict:
    """4 GiB read once: XLA's column sum and the fastest Pallas read kernel of kernels_h200.py."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    rows, cols = (1 << 22, 512) if not INTERPRET else (1 << 10, 128)
    x = jax.random.normal(jax.random.PRNGKey(0), (rows, cols), jnp.bfloat16)
    nbytes, out = x.size * 2, {"bytes": x.size * 2}
    rb, chunk, nw, ns = (4096, 64, 8, 3) if not INTERPRET else (256, 64, 4, 1)

    def kernel(x_ref, o_ref):
        def body(i, acc):
            return acc + x_ref[pl.ds(i * chunk, chunk), :].astype(jnp.float32)
        acc = jax.lax.fori_loop(0, rb // chunk, body, jnp.zeros((chunk, cols), jnp.float32))
        o_ref[...] = jnp.sum(acc, axis=0, keepdims=True)
    pallas = jax.jit(lambda x: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows // rb, cols), jnp.float32), grid=(rows // rb,),
        in_specs=[pl.BlockSpec((rb, cols), lambda i: (i, 0))], out_specs=pl.BlockSpec((1, cols), lambda i: (i, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=nw, num_stages=ns), interpret=INTERPRET)(x))
    xla = jax.jit(lambda x: jnp.sum(x, axis=0, dtype=jnp.float32))
    for name, f in (("xla_colsum", xla), ("pallas_read", pallas)):
        row = {"wall_TBps": nbytes / timed(f, x) / 1e12}
        evs = by_name(device_kernel_events(f, x))
        if not evs:  # no device plane (CPU smoke run)
            out[name] = row
            continue
        main = next(iter(evs.items()))
        row.update(kernel=main[0], kernel_TBps=nbytes / main[1][1] / 1e12,
                   all_kernels_TBps=nbytes / sum(v[1] for v in evs.values()) / 1e12)
        out[name] = row
        log("read", name, row)
    return out


# --------------------------------------------------------------------------- GEMV

def chained(gemm, calls: int):
    """jit(x, weights): `calls` dependent calls as straight-line code, cycling over the copies."""
    def run(x, weights):
        for i in range(calls):
            y = gemm(x, weights[i % len(weights)])
            x = x + (y[:, :1] * 0.0).astype(x.dtype)
        return x
    return jax.jit(run)


def gemv_part() -> dict:
    res = {}
    for shape in SHAPES:
        k, n = shape
        nbytes = 2 * k * n
        copies = max(1, int(np.ceil(3 * L2_BYTES / (0.75 * nbytes))))
        bits = [random_bits(kk, shape) for kk in jax.random.split(jax.random.PRNGKey(k + n), copies)]
        w16 = [jax.lax.bitcast_convert_type(b, jnp.bfloat16) for b in bits]
        c16, c12 = tuned_config(shape, "bf16", device=DEVICE), tuned_config(shape, "lh12", device=DEVICE)
        formats = {
            "xla": (lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), w16),
            "ours_bf16": (skinny_gemm, [prepare_bf16(w, c16, INTERPRET) for w in w16]),
            "ours_lh12": (skinny_gemm_lh12, [prepare_lh12(*pack_for_kernel(b, c12)[:1], c12, INTERPRET,
                                                          natural_order(shape, c12)) for b in bits]),
        }
        reps = max(2, int(2e-3 / (nbytes / 4e12 * copies)))
        entry = {"copies": copies, "fori_reps": reps, "config_bf16": str(c16), "config_lh12": str(c12)}
        for fmt_, (gemm, ws) in formats.items():
            for t in TOKENS:
                x = jax.random.normal(jax.random.PRNGKey(t), (t, k), jnp.bfloat16)
                row = {}
                if time.time() - T0 > FINISH_BY_S:
                    row["error"] = "skipped: past --finish-by-s"
                    entry[f"{fmt_}_T{t}"] = row
                    continue
                try:
                    f = chained(gemm, CALLS)
                    if not KERNEL_ONLY:
                        row["fori_TBps"] = nbytes * copies * reps / timed(looped(gemm, reps), x, ws) / 1e12
                        row["unrolled_TBps"] = nbytes * CALLS / timed(f, x, ws) / 1e12
                    evs = by_name(device_kernel_events(f, x, ws))
                    if not evs:  # no device plane (CPU smoke run)
                        raise RuntimeError("the profiler saw no device kernels")
                    main_name, (count, secs) = next(iter(evs.items()))
                    per_call = sum(v[1] for v in evs.values()) / CALLS
                    row.update(kernel=main_name, kernel_count=count, kernel_us=secs / count * 1e6,
                               kernel_TBps=nbytes / (secs / count) / 1e12,
                               all_kernels_us_per_call=per_call * 1e6, all_kernels_TBps=nbytes / per_call / 1e12,
                               kernels_per_call=sum(v[0] for v in evs.values()) / CALLS)
                except Exception as e:  # noqa: BLE001 - record and go on
                    row["error"] = repr(e)[:400]
                entry[f"{fmt_}_T{t}"] = row
                log(f"{k}x{n}", fmt_, t, {a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items()})
        res[f"{k}x{n}"] = entry
        RESULTS["gemv"] = res
        save()
    return res


def rows_part() -> dict:
    """Correctness first: under this device's tuned configs (wide-step settings included), rows of
    a 64-row GEMM equal 1-row GEMMs bit for bit, and the 12-bit kernel equals the bf16 one."""
    res = {}
    for shape in STEP_SHAPES:
        k, n = shape
        bits = random_bits(jax.random.PRNGKey(k * 7 + n), shape)
        w16 = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
        c16, c12 = tuned_config(shape, "bf16", device=DEVICE), tuned_config(shape, "lh12", device=DEVICE)
        gw = prepare_bf16(w16, c16, INTERPRET)
        lw = prepare_lh12(*pack_for_kernel(bits, c12)[:1], c12, INTERPRET, natural_order(shape, c12))
        x = jax.random.normal(jax.random.PRNGKey(1), (64, k), jnp.bfloat16)
        u32 = lambda y: np.asarray(y, np.float32).view(np.uint32)
        wide16, wide12 = u32(skinny_gemm(x, gw)), u32(skinny_gemm_lh12(x, lw))
        rows_ok = all((u32(skinny_gemm(x[t:t + 1], gw))[0] == wide16[t]).all() and
                      (u32(skinny_gemm_lh12(x[t:t + 1], lw))[0] == wide12[t]).all() for t in (0, 17, 63))
        res[f"{k}x{n}"] = {"rows_bitwise": bool(rows_ok), "lh12_equals_bf16": bool((wide16 == wide12).all()),
                           "wide_bf16": str(c16.wide), "wide_lh12": str(c12.wide)}
        log("rows", f"{k}x{n}", res[f"{k}x{n}"])
    RESULTS["rows"] = res
    save()
    return res


# --------------------------------------------------------------------------- decode step

def step_variants(names):
    from specjax.models.config import ModelConfig
    from specjax.models.kernel_params import prepare_kernel_params
    from specjax.models.params import init_random_params
    cfg = ModelConfig(**LLAMA3_8B)
    params = init_random_params(cfg, jax.random.PRNGKey(0))
    configs = {(s, f): tuned_config(s, f, device=DEVICE)
               for s in STEP_SHAPES
               for f in ("bf16", "lh12")}
    out, prepared = {}, {}
    for name in names:
        if name == "xla":
            out[name] = params
            continue
        # ours_<format>[_nowide][_split<S>]: _nowide drops the tuned wide-step settings (T > 16);
        # _split<S> runs the attention kernel with split_s = S (`attention_split`)
        fmt_, nowide = name.split("_")[1], "_nowide" in name
        if (fmt_, nowide) not in prepared:
            cfgs = configs if not nowide else {k: dataclasses.replace(c, wide=None) for k, c in configs.items()}
            prepared[fmt_, nowide], _ = prepare_kernel_params(
                params, cfg, {g: fmt_ for g in ("attn", "mlp", "head")}, interpret=INTERPRET, configs=cfgs)
        out[name] = prepared[fmt_, nowide]
    return cfg, out


@contextlib.contextmanager
def attention_split(name: str):
    """Within (for a variant named ..._split<S>): the step's attention kernel with key slots split
    into programs of S (numerics: AR and verify steps must share it; the default is 256)."""
    m = re.search(r"_split(\d+)", name)
    from specjax.models import transformer
    from pallas_kernels.decode_attention import AttentionConfig, decode_attention
    if m:
        transformer.decode_attention = functools.partial(
            decode_attention, config=AttentionConfig(block_s=min(64, int(m.group(1))), split_s=int(m.group(1))))
    try:
        yield
    finally:
        transformer.decode_attention = decode_attention


def step_fn(cfg, t: int, reps: int):
    from specjax.models.kv_cache import init_cache
    from specjax.models.transformer import forward, lm_logits
    cache = init_cache(cfg, 1, CONTEXT + 64)
    start = jnp.array([CONTEXT], jnp.int32)
    pos = CONTEXT + jnp.arange(t, dtype=jnp.int32)[None, :]

    @exact_jit  # compiled as the engine compiles its steps (specjax/rounding.py)
    def run(params, cache, tokens):
        def body(_, carry):
            cache, tokens = carry
            hidden, cache = forward(params, cfg, tokens, pos, cache, start)
            return cache, jnp.argmax(lm_logits(params, hidden), axis=-1).astype(jnp.int32)
        return jax.lax.fori_loop(0, reps, body, (cache, tokens))[1]
    return run, cache, jnp.zeros((1, t), jnp.int32) + 7


def weight_bytes(params) -> int:
    from specjax.models.linear import is_kernel_weight
    w = 0
    for leaf in jax.tree.leaves(params, is_leaf=is_kernel_weight):
        if is_kernel_weight(leaf):
            w += leaf.nbytes if hasattr(leaf, "tile_escapes") else leaf.w.size * 2
        else:
            w += leaf.size * leaf.dtype.itemsize
    return w - params.embed.size * params.embed.dtype.itemsize  # the embedding is gathered, not streamed


def step_part(names, profile: bool = True, tokens=(1, 16, 64), reps: int = 8) -> dict:
    tokens = STEP_TOKENS if profile else tokens
    cfg, variants = step_variants(names)
    read = RESULTS.get("read", {}).get("pallas_read", {}).get("kernel_TBps")
    out = {}
    for name, params in variants.items():
        row = {"weight_bytes": weight_bytes(params)}
        for t in tokens:
            if time.time() - T0 > FINISH_BY_S:
                row[f"T{t}"] = {"error": "skipped: past --finish-by-s"}
                continue
            try:
                with attention_split(name):  # traced (first call) inside
                    run, cache, toks = step_fn(cfg, t, reps)
                    wall = timed(run, params, cache, toks, repeats=3) / reps
                # the tokens after `reps` dependent steps (variants of one numerics agree)
                cell = {"wall_ms": wall * 1e3, "tokens": np.asarray(run(params, cache, toks)).ravel().tolist()}
                if profile:
                    evs = by_name(device_kernel_events(run, params, cache, toks))
                    kinds: dict = collections.defaultdict(float)
                    for kname, (_, s) in evs.items():
                        kinds[kind_of(kname)] += s / reps * 1e3
                    busy = sum(kinds.values())
                    cell.update(kernels_ms=busy, gaps_ms=wall * 1e3 - busy,
                                kernels_per_step=sum(v[0] for v in evs.values()) / reps,
                                by_kind_ms=dict(kinds),
                                top=[(k, c / reps, s / reps * 1e6) for k, (c, s) in list(evs.items())[:12]],
                                kernels=[(k, c / reps, s / reps * 1e6) for k, (c, s) in evs.items()])
                    if read:
                        cell["gemm_floor_ms"] = row["weight_bytes"] / (read * 1e12) * 1e3
                row[f"T{t}"] = cell
            except Exception as e:  # noqa: BLE001
                row[f"T{t}"] = {"error": repr(e)[:400]}
            log("step", name, t, row[f"T{t}"])
        out[name] = row
        RESULTS.setdefault("step", {}).update({name: row})
        save()
    return out


def flags_part() -> dict:
    """The step's wall time (T = 1) in fresh processes under each FLAG_SETS entry."""
    out = {}
    for label, flags in FLAG_SETS.items():
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
        with tempfile.TemporaryDirectory() as d:
            env["OUT"] = d
            cmd = [sys.executable, __file__, "--parts", "step_wall"] + (["--smoke"] if INTERPRET else [])
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
            try:
                out[label] = {"flags": flags, **json.loads(Path(d, "timing_h200.json").read_text())["step"]}
            except Exception:  # noqa: BLE001
                out[label] = {"flags": flags, "error": (p.stdout + p.stderr)[-600:]}
        log("flags", label, out[label])
        RESULTS["flags"] = out
        save()
    return out


# --------------------------------------------------------------------------- main

def table():
    print("\nTB/s (bf16-equivalent bytes / time): fori loop | unrolled | kernel alone")
    for key, e in RESULTS.get("gemv", {}).items():
        for f in ("xla", "ours_bf16", "ours_lh12"):
            cells = []
            for t in TOKENS:
                r = e.get(f"{f}_T{t}", {})
                cells.append(f"T{t} {r.get('fori_TBps', float('nan')):.2f} {r.get('unrolled_TBps', float('nan')):.2f} "
                             f"{r.get('kernel_TBps', float('nan')):.2f}")

            print(f"{key:>12} {f:>10}  " + "   ".join(cells))
    for name in ("xla_colsum", "pallas_read"):
        r = RESULTS.get("read", {}).get(name)
        if r:
            print(f"read {name:>12}: wall {r['wall_TBps']:.2f}, kernel {r.get('kernel_TBps', float('nan')):.2f} TB/s")
    print("\n8B step, ms: wall = kernels + gaps (kernels by kind)")
    for name, row in RESULTS.get("step", {}).items():
        for t in STEP_TOKENS:
            c = row.get(f"T{t}")
            if c and "kernels_ms" in c:
                kinds = " ".join(f"{k}={v:.3f}" for k, v in c["by_kind_ms"].items())
                print(f"{name:>10} T{t:<3} wall {c['wall_ms']:.3f} = {c['kernels_ms']:.3f} + gaps {c['gaps_ms']:.3f}"
                      f" ({c['kernels_per_step']:.0f} kernels) {kinds}")
    for label, r in RESULTS.get("flags", {}).items():
        walls = {n: v.get("T1", {}).get("wall_ms") for n, v in r.items() if isinstance(v, dict)}
        print(f"flags {label:>18}: T1 wall ms {walls}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="read,gemv,step,flags")
    ap.add_argument("--steps", default="xla,ours_bf16,ours_lh12")
    ap.add_argument("--tiles-of", help="read another device's tile cache (e.g. h200); default: this device's")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU check)")
    ap.add_argument("--tokens", default="1,16", help="GEMV rows T to time (the step always runs T = 1, 16, 64)")
    ap.add_argument("--step-tokens", default="1,16,64", help="rows T of the timed decode/verify steps")
    ap.add_argument("--timers", default="all", choices=["all", "kernel"],
                    help="kernel: GEMVs timed by the profiler only (no fori / unrolled wall clocks)")
    ap.add_argument("--finish-by-s", type=float, default=float("inf"),
                    help="start no new measurement after this many seconds (the rest is recorded as skipped)")
    args = ap.parse_args()
    global DEVICE, TOKENS, KERNEL_ONLY, FINISH_BY_S, STEP_TOKENS
    STEP_TOKENS = tuple(int(t) for t in args.step_tokens.split(","))
    DEVICE = args.tiles_of
    TOKENS = [int(t) for t in args.tokens.split(",")]
    KERNEL_ONLY = args.timers == "kernel"
    FINISH_BY_S = args.finish_by_s
    if args.smoke:
        global INTERPRET, SHAPES, L2_BYTES, CALLS
        global STEP_SHAPES
        INTERPRET, SHAPES, L2_BYTES, CALLS = True, [(256, 1024)], 1e6, 3
        STEP_SHAPES = [(128, 256), (256, 128)]
        LLAMA3_8B.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=32)
    from specjax.costmodel.hardware import current_device_name
    RESULTS["meta"] = {"tiles_of": DEVICE or current_device_name(),"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "commit": code_commit(),
                       "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                       "xla_flags": os.environ.get("XLA_FLAGS", "")}
    parts = args.parts.split(",")
    steps = args.steps.split(",")
    if "read" in parts:
        RESULTS["read"] = read_part()
        save()
    if "rows" in parts:
        rows_part()
    if "gemv" in parts:
        gemv_part()
    if "step" in parts:
        step_part(steps)
    if "step_wall" in parts:  # a `flags` subprocess: wall time only, T = 1
        step_part(["xla", "ours_bf16"], profile=False, tokens=(1,))
    if "flags" in parts:
        flags_part()
    save()
    table()


if __name__ == "__main__":
    main()
