"""specjax/profiling.py on the CPU: the aggregation, and a clear refusal where no device kernel
is traced (the kernel timer must never report 0 s for a GPU-less run)."""

import jax
import jax.numpy as jnp
import pytest

from specjax.profiling import by_name, device_kernel_events, kernel_seconds
from specjax.search.kernel_timer import KernelTimer


def test_by_name_counts_and_sums_largest_first():
    events = [("a", 1e-6), ("b", 5e-6), ("a", 2e-6), ("c", 0.5e-6), ("b", 1e-6)]
    agg = by_name(events)
    assert list(agg) == ["b", "a", "c"]
    assert agg["b"][0] == 2 and agg["b"][1] == pytest.approx(6e-6)
    assert agg["a"] == (2, pytest.approx(3e-6))


def test_cpu_trace_has_no_device_kernels_and_kernel_seconds_refuses():
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((64, 64))
    assert device_kernel_events(f, x) == []  # the trace ran; the CPU has no device plane
    with pytest.raises(RuntimeError, match="no device kernels"):
        kernel_seconds(f, x)


def test_kernel_timer_rejects_unknown_method():
    with pytest.raises(ValueError, match="kernel' or 'loop"):
        KernelTimer(method="wallclock")
