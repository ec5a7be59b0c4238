"""Device kernel times from a profiler trace: what each kernel itself took on the GPU, with no
launch gap, loop overhead or host dispatch counted.

Why not a host clock around a jit'd loop: on the lent H100 (2026-12-06, docs/results/timing_h100.md)
one GEMV per `lax.fori_loop` iteration costs ~20 us more than the kernel (2.56 vs 2.96 TB/s on
8192x28672), which hides up to half of a small kernel and ranks tile configs by the loop's cost.
`jax.profiler` records CUPTI's kernel durations; `ProfileData` reads them back in-process.
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile

import jax

# Lines of the device plane that XLA derives from the kernels (not kernels themselves).
DERIVED_LINES = ("XLA Ops", "XLA Modules", "Steps", "Framework", "Source", "XLA TraceMe", "Launch")


def device_kernel_events(fn, *args) -> list[tuple[str, float]]:
    """(kernel name, seconds) of every device kernel and memcpy that one call of `fn(*args)` ran.
    Empty on a platform whose profiler has no device plane (the CPU)."""
    jax.block_until_ready(fn(*args))  # compile and warm up outside the trace
    events = []
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready(fn(*args))
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise RuntimeError(f"the profiler wrote no trace under {d}")
        for plane in jax.profiler.ProfileData.from_file(paths[0]).planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if not line.name.startswith(DERIVED_LINES):
                    events += [(e.name, e.duration_ns * 1e-9) for e in line.events]
    return events


def by_name(events: list[tuple[str, float]]) -> dict[str, tuple[int, float]]:
    """name -> (count, total seconds), largest total first."""
    agg: dict = collections.defaultdict(lambda: [0, 0.0])
    for name, seconds in events:
        agg[name][0] += 1
        agg[name][1] += seconds
    return {k: (v[0], v[1]) for k, v in sorted(agg.items(), key=lambda kv: -kv[1][1])}


def kernel_seconds(fn, *args) -> float:
    """Total device kernel time of one call of `fn(*args)`; raises where no device kernel is seen."""
    events = device_kernel_events(fn, *args)
    if not events:
        raise RuntimeError(f"the profiler saw no device kernels on {jax.devices()[0].platform}; "
                           "kernel timing needs a GPU")
    return sum(s for _, s in events)
