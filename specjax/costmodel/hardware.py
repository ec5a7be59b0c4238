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


# Nominal figures. H200: the read bandwidth and matmul rate measured there on 2026-12-02
# (../shared/device/); H100 SXM: datasheet peaks with the same achievable fractions.
NOMINAL = {
    "h200": DeviceModel("h200", 4.07e12, 636e12, 8e-6, 20e-6, 4.8e12, 989e12),
    "h100-sxm": DeviceModel("h100-sxm", 3.35e12 * 0.85, 636e12, 8e-6, 20e-6, 3.35e12, 989e12),
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
    """Measure the device present (a few seconds) and store the numbers per device."""
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
    if store_dir is not None:
        write_json_atomic(Path(store_dir) / "calibration" / f"{name}.json", dataclasses.asdict(model))
    return model


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


def fit_to_target(dev: DeviceModel, cfg, params, num_slots: int = 256, widths=(1, 4, 8, 16)) -> DeviceModel:
    """Refit the fixed cost and the matmul rate to timed forwards of the real target at several
    widths (skinny matmuls run far below a square matmul's rate, on CPUs especially)."""
    import numpy as np

    from specjax.costmodel.model import ModelDims
    from specjax.models.kv_cache import init_cache
    from specjax.models.transformer import forward, lm_logits

    dims = ModelDims.of(cfg, num_slots)
    cache = init_cache(cfg, 1, num_slots)
    step = jax.jit(lambda p, c, t, pos: lm_logits(p, forward(p, cfg, t, pos, c, pos[:, 0])[0]))
    times = {}
    for n in widths:
        tok = jnp.zeros((1, n), jnp.int32)
        pos = (8 + jnp.arange(n, dtype=jnp.int32))[None]
        times[n] = _time_loop(step, params, cache, tok, pos)
    layers = cfg.num_layers
    bytes_ = layers * (dims.layer_bytes + num_slots * dims.kv_bytes_per_slot) + dims.head_bytes
    flops_tok = layers * (dims.layer_flops + num_slots * dims.attn_flops_per_slot) + dims.head_flops
    overhead = max(times[widths[0]] - bytes_ / dev.bandwidth, 0.05 * times[widths[0]])
    rates = [n * flops_tok / max(times[n] - overhead, 1e-9) for n in widths[1:]]
    flops = float(np.median(rates)) if rates else dev.flops
    return dataclasses.replace(dev, step_overhead=overhead, flops=min(flops, dev.peak_flops),
                               source=dev.source + "+target-fit")
