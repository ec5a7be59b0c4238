"""What the skinny-GEMM probes (swapped_gemm_probe.py, fma_gemm_probe.py) share: a results dict
saved as $OUT/NAME.json after each step, timestamped log lines, one row per timed kernel, and the
per-call device time of dependent calls inside one jit."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax

from specjax.profiling import kernel_seconds
from specjax.search.kernel_timer import looped


class ProbeLog:
    def __init__(self, name: str):
        self.name, self.t0 = name, time.time()
        self.out = Path(os.environ.get("OUT", "/tmp"))
        self.res: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                          "date": time.strftime("%Y-%m-%d"), "rows": [], "errors": []}

    def log(self, *a):
        print(f"[{time.time() - self.t0:6.1f}s]", *a, flush=True)

    def save(self):
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"{self.name}.json").write_text(json.dumps(self.res, indent=1))

    def row(self, k, n, t, name, s, **extra):
        """A kernel's time s on a K x N weight at T rows; TB/s of bf16-equivalent bytes (2 K N)."""
        r = {"shape": [k, n], "T": t, "kernel": name, "us": s * 1e6, "tbps": 2 * k * n / s / 1e12, **extra}
        self.res["rows"].append(r)
        self.log(f"{k}x{n} T={t:<3d} {name:34s} {s * 1e6:8.1f} us {r['tbps']:.2f} TB/s {extra or ''}")

    def engine_rows(self, k, n, t, timer):
        """XLA's GEMM and the engine's bf16 and 12-bit kernels (tuned configs, their own random
        weights) at this shape and T; a failure is recorded and the probe goes on."""
        from specjax.search.kernel_tuner import tuned_config
        for fmt in ("xla", "bf16", "lh12"):
            try:
                cfg = tuned_config((k, n), "bf16" if fmt == "xla" else fmt)
                self.row(k, n, t, f"engine_{fmt}", timer((k, n), fmt, cfg, t))
            except Exception as e:  # noqa: BLE001 - record and go on
                self.res["errors"].append(f"engine {fmt} {k}x{n} T{t}: {e!r}"[:600])

    def print_errors(self):
        print("errors:", len(self.res["errors"]))
        for e in self.res["errors"][:6]:
            print(" ", e[:600])


def per_call(gemm, x, ws) -> float:
    """Device seconds of one gemm(x, w) call: 4 rounds over every weight copy in one jit."""
    reps = 4
    return kernel_seconds(looped(gemm, reps), x, ws) / (reps * len(ws))
