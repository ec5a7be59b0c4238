"""Device numbers the cost model needs: achievable read bandwidth and matmul rate, fixed costs per
forward and per speculative round, and the physical ceilings used as floors.

Named devices carry nominal numbers; `calibrate()` measures the device present with
microbenchmarks and stores the result per device (memory_store/calibration/<device>.json).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.atomic import read_json_checked, write_json_atomic


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    name: str
    bandwidth: float  # achievable streaming read, bytes/s
    flops: float  # achievable matmul rate at the model dtype, FLOP/s
    step_overhead: float  # fixed seconds per target/drafter forward (launches, small ops)
    round_overhead: float  # fixed seconds per speculative round (accept, commit, loop)
    peak_bandwidth: float  # physical ceilings: nothing real runs faster than bytes/peak
    peak_flops: float
    source: str = "nominal"  # nominal | calibrated | spec
    layer_overhead: float = 0.0  # fixed seconds per layer of a forward (kernel launches scale with depth)
    host_per_token: float = 0.0  # host-side seconds per generated token (prefill, dispatch, transfers)
    host_sync: float = 1e-4  # one synchronizing host round trip (H200: ~0.1 ms), per serving call
    # Skinny GEMM kernels (pallas_kernels/), as fractions of `bandwidth`; 1.0 until measured, and
    # defaulted so calibration files written before they existed still load.
    lh12_efficiency: float = 1.0  # LH12 kernel's read rate over its own bytes / the bf16 kernel's
    tuned_efficiency: float = 1.0  # tuned tiles' speed / default tiles' speed (tune-kernels cache)
    pallas_efficiency: float = 1.0  # our bf16 kernel's speed / XLA's GEMM on the same weight and rows
    kernels_source: str = "default"  # where the two figures came from, or why they were not measured
    # Tensor parallelism: all-reduce bus bandwidth per device (bytes/s) and one collective's fixed
    # latency. Nominal NVLink-class figures, not measured here (no multi-GPU machine has been lent).
    link_bandwidth: float = 350e9
    collective_latency: float = 10e-6


# Nominal figures. H200: the read bandwidth and matmul rate measured there on 2026-12-02
# (../shared/device/); H100 SXM: datasheet peaks with the same achievable fractions.
NOMINAL = {
    # pallas_efficiency: the 8B-shaped decode step at T = 1 with our bf16 GEMMs vs XLA's, 4.383 /
    # 4.756 ms (docs/results/kernels_h200.md); kernel calibration replaces it per device
    "h200": DeviceModel("h200", 4.07e12, 636e12, 8e-6, 20e-6, 4.8e12, 989e12, pallas_efficiency=0.92),
    "h100-sxm": DeviceModel("h100-sxm", 3.35e12 * 0.85, 636e12, 8e-6, 20e-6, 3.35e12, 989e12,
                            pallas_efficiency=0.92),
    "cpu": DeviceModel("cpu", 20e9, 40e9, 1e-3, 1e-3, 60e9, 200e9),
}


def current_device_name() -> str:
    d = jax.devices()[0]
    if d.platform == "cpu":
        return f"cpu-{os.cpu_count()}core"
    kind = d.device_kind.lower()
    for short in ("h200", "h100"):
        if short in kind:
            return "h100-sxm" if short == "h100" else short
    return kind.replace(" ", "-")


def _time_loop(fn, *args, repeats: int = 5) -> float:
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def measure_read_bandwidth(nbytes: int, iters: int = 4) -> float:
    x = jnp.ones((nbytes // 4,), jnp.float32)

    @jax.jit
    def stream(x):  # dependent iterations so none can be skipped or fused away
        def body(i, acc):
            return acc + jnp.sum(x * (1.0 + acc * 0.0))
        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))
    return nbytes * iters / _time_loop(stream, x)


def measure_matmul_rate(m: int, n: int, k: int, dtype) -> float:
    a = jnp.ones((m, k), dtype)
    b = jnp.ones((k, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    return 2 * m * n * k / _time_loop(f, a, b)


def calibrate(store_dir: str | Path | None = None, small: bool | None = None) -> DeviceModel:
    """Measure the device present (a few seconds) and store the numbers per device; on a GPU the
    skinny GEMM kernels' efficiencies too (`calibrate_kernels`)."""
    name = current_device_name()
    cpu = jax.devices()[0].platform == "cpu"
    small = cpu if small is None else small
    bw = measure_read_bandwidth(256 << 20 if small else 4 << 30)
    rate = measure_matmul_rate(256, 2048, 2048, jnp.float32) if cpu else \
        measure_matmul_rate(8192, 8192, 8192, jnp.bfloat16)
    overhead = _time_loop(jax.jit(lambda x: x + 1), jnp.ones((8,)), repeats=20)
    model = DeviceModel(name=name, bandwidth=bw, flops=rate, step_overhead=overhead * 4,
                        round_overhead=overhead * 8, peak_bandwidth=bw * 1.25, peak_flops=rate * 1.5,
                        source="calibrated")
    if not cpu:
        try:
            model, _ = calibrate_kernels(model, store_dir=store_dir)
        except Exception as e:  # noqa: BLE001 - a kernel that fails to build must not lose the rest
            model = dataclasses.replace(model, kernels_source=f"failed: {type(e).__name__}: {e}"[:300])
    if store_dir is not None:
        write_json_atomic(Path(store_dir) / "calibration" / f"{name}.json", dataclasses.asdict(model))
    return model


KERNEL_CALIBRATION_SHAPE = (4096, 14336)  # an 8B-class w_gate_up half: large enough to stream from HBM


def calibrate_kernels(dev: DeviceModel, shape: tuple[int, int] = KERNEL_CALIBRATION_SHAPE,
                      store_dir: str | Path | None = None, time_fn=None, tokens=(1, 16)
                      ) -> tuple[DeviceModel, str]:
    """Measure the skinny GEMM kernels' efficiencies on one model-shaped weight -> (model, note).

    lh12_efficiency = (LH12 bytes / t_lh12) / (bf16 bytes / t_bf16), LH12 bytes taken at the
    registry's nominal bits, so the cost model's lh12 read time (bytes * bits/16 / (bw * eff))
    comes out at t_lh12 / t_bf16 of the bf16 one. pallas_efficiency = t_xla / t_bf16 (XLA's GEMM
    on the same bf16 weight against our kernel). tuned_efficiency = t_default / t_tuned over the
    tiles `specjax tune-kernels` stored for `shape` on `dev.name` (1.0 when it stored none).
    Times sum T = `tokens` (decode and verify widths). `time_fn(shape, fmt, config, T)`: seconds
    per call, the GPU timer of specjax/search/kernel_timer.py unless given (tests pass a fake).
    Without a GPU and without `time_fn` it measures nothing: the kernels need a GPU, and their
    interpret mode runs the kernel body in Python, so its timings say nothing about a GPU."""
    from specjax.search.registry import LH12_NOMINAL_BITS

    if time_fn is None:
        platform = jax.devices()[0].platform
        if platform != "gpu":
            note = (f"kernel calibration skipped: it needs a GPU (found {platform}); the skinny GEMMs "
                    "run nowhere else, and interpret-mode timings mean nothing. lh12_efficiency and "
                    "tuned_efficiency stay 1.0")
            return dataclasses.replace(dev, kernels_source=f"skipped: needs a GPU (found {platform})"), note
        from specjax.search.kernel_timer import KernelTimer
        time_fn = KernelTimer()
    from specjax.search.kernel_tuner import default_tiles, tuned_config

    def total(fmt, cfg):
        return sum(time_fn(shape, fmt, cfg, t) for t in tokens)

    default = {fmt: default_tiles(shape, fmt) for fmt in ("bf16", "lh12")}
    t16, t12 = total("bf16", default["bf16"]), total("lh12", default["lh12"])
    lh12_eff = (LH12_NOMINAL_BITS / 16.0) * t16 / t12
    pallas_eff = total("xla", None) / t16
    tuned = {fmt: tuned_config(shape, fmt, device=dev.name, store_dir=store_dir or "memory_store")
             for fmt in ("bf16", "lh12")}
    tuned_eff, what = 1.0, "no tuned tiles stored"
    if tuned != default:
        tuned_eff = (t16 + t12) / (total("bf16", tuned["bf16"]) + total("lh12", tuned["lh12"]))
        what = "tuned tiles from the tune-kernels cache"
    key = f"{shape[0]}x{shape[1]}"
    note = (f"kernels on {key}: our bf16 kernel at {pallas_eff:.2f} of XLA's speed, LH12 {lh12_eff:.2f} "
            f"of the bf16 kernel's read rate per byte, tuned tiles x{tuned_eff:.2f} ({what})")
    return dataclasses.replace(dev, lh12_efficiency=lh12_eff, tuned_efficiency=tuned_eff,
                               pallas_efficiency=pallas_eff,
                               kernels_source=f"calibrated on {key}"), note


def load_calibration(store_dir: str | Path, name: str) -> DeviceModel | None:
    path = Path(store_dir) / "calibration" / f"{name}.json"
    if not path.exists():
        return None
    return DeviceModel(**read_json_checked(path))


def resolve_hardware(hw, store_dir: str | Path) -> DeviceModel:
    """The spec's hardware -> DeviceModel: explicit numbers win, then a stored calibration of that
    device, then the nominal table (a CPU spec with no calibration is calibrated now)."""
    if hw.name.startswith("cpu"):  # CPUs differ too much for a table: use this machine's numbers
        base = load_calibration(store_dir, current_device_name()) or calibrate(store_dir)
    else:
        base = load_calibration(store_dir, hw.name) or NOMINAL.get(hw.name)
        if base is None:
            base = dataclasses.replace(NOMINAL["h200"], name=hw.name)
    changes = {}
    if hw.bandwidth_GBps:
        changes.update(bandwidth=hw.bandwidth_GBps * 1e9, peak_bandwidth=hw.bandwidth_GBps * 1e9 * 1.15)
    if hw.peak_tflops:
        changes.update(flops=hw.peak_tflops * 1e12 * 0.65, peak_flops=hw.peak_tflops * 1e12)
    if hw.step_overhead_us:
        changes.update(step_overhead=hw.step_overhead_us * 1e-6)
    name = current_device_name() if hw.name.startswith("cpu") else hw.name
    return dataclasses.replace(base, name=name, source="spec" if changes else base.source, **changes)


def _time_forward_in_loop(step, params, cache, n: int, iters: int = 8) -> float:
    """Seconds per forward of width n, as `iters` dependent forwards inside one jit: decode loops run
    on the device, so host dispatch (~0.1 ms a call on a GPU) must stay out of the fixed cost."""
    tok = jnp.zeros((1, n), jnp.int32)
    pos = (8 + jnp.arange(n, dtype=jnp.int32))[None]

    @jax.jit
    def loop(params, cache, tok, pos):
        def body(i, acc):  # the next input depends on the last output, so nothing is hoisted
            logits = step(params, cache, tok + (acc > 1e30).astype(jnp.int32), pos)
            return acc + logits[0, 0, 0].astype(jnp.float32)
        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))
    return _time_loop(loop, params, cache, tok, pos) / iters


def fit_to_target(dev: DeviceModel, cfg, params, num_slots: int = 256, widths=(1, 4, 8, 16)) -> DeviceModel:
    """Refit the fixed costs and the matmul rate to timed forwards of the real target: the fixed cost
    split into per forward and per layer (full depth against a quarter of it, width 1), the rate from
    wider forwards (skinny matmuls run far below a square matmul's rate, on CPUs especially)."""
    import numpy as np

    from specjax.costmodel.model import ModelDims
    from specjax.models.target import init_target_cache, is_hybrid, target_forward, target_logits

    def step_fn(c):
        return lambda p, cache, t, pos: target_logits(p, c, target_forward(p, c, t, pos, cache, pos[:, 0])[0])

    dims = ModelDims.of(cfg, num_slots)
    L, Lq = cfg.num_layers, max(1, cfg.num_layers // 4)
    times = {n: _time_forward_in_loop(step_fn(cfg), params, init_target_cache(cfg, 1, num_slots), n)
             for n in widths}
    qcfg = dataclasses.replace(cfg, num_layers=Lq, **({"layer_types": cfg.layer_types[:Lq]} if is_hybrid(cfg) else {}))
    qparams = dataclasses.replace(params, layers=list(params.layers[:Lq]))
    t_quarter = _time_forward_in_loop(step_fn(qcfg), qparams, init_target_cache(qcfg, 1, num_slots), 1)

    def read_s(layers):
        return (layers * (dims.layer_bytes + num_slots * dims.kv_bytes_per_slot) + dims.head_bytes) / dev.bandwidth
    t_full = times[widths[0]]
    per_layer = max((t_full - t_quarter - (read_s(L) - read_s(Lq))) / max(L - Lq, 1), 0.0)
    overhead = max(t_full - read_s(L) - L * per_layer, 0.02 * t_full)
    flops_tok = L * (dims.layer_flops + num_slots * dims.attn_flops_per_slot) + dims.head_flops
    fixed = overhead + L * per_layer
    rates = [n * flops_tok / max(times[n] - fixed, 1e-9) for n in widths[1:]]
    flops = float(np.median(rates)) if rates else dev.flops
    return dataclasses.replace(dev, step_overhead=overhead, layer_overhead=per_layer,
                               flops=min(flops, dev.peak_flops), source=dev.source + "+target-fit")


def fit_to_ar(dev: DeviceModel, ar_seconds: float, ar_decode_s: float, ar_steps: int, tokens: int,
              ar_forward_s: float) -> DeviceModel:
    """Refit two fixed costs from the measured AR baseline: the per-step commit (AR's in-loop step =
    one forward + commit; the cost model charges AR half a speculative round's commit) and the host
    cost per token (everything outside the decode loop: prefill, dispatch, transfers)."""
    commit = max(ar_decode_s / max(ar_steps, 1) - ar_forward_s, 0.0)
    host = max(ar_seconds - ar_decode_s, 0.0) / max(tokens, 1)
    return dataclasses.replace(dev, round_overhead=2.0 * commit, host_per_token=host,
                               source=dev.source + "+ar-fit")
