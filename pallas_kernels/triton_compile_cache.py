"""One Triton compile per distinct kernel module in a process.

JAX's Triton lowering (`pallas_call` on a GPU) compiles every call site's module (TTIR -> PTX)
on its own, even where sites lower to the same bytes: a decode step calls one GEMM kernel per
weight matrix, and SmolLM2's 120 matrices come in 5 shapes, so the step compiled each kernel
~24 times. For the bf16 kernel that is cheap (the bf16 AR's first call: 17 s); the 12-bit
kernel's decode and escape paths make each compile slow, and its decoder's first call took 427 s
(H200) and, after one trace a shape, still 310 s (H100, 2026-12-07). The GEMM wrappers trace
once a shape (`skinny_gemm`, `skinny_gemm_lh12` are jit'd), so those sites share one module's
bytes; `install` memoizes `jax._src.lib.triton.compile` on (platform, module digest, arch, warps,
CTAs, stages). A compile is a pure function of those, so reusing its result changes nothing but
the time. Installed on import of `pallas_kernels`; where this JAX has no such hook (other
versions, CPU-only installs that lack jaxlib's Triton module) it does nothing.
"""

from __future__ import annotations

import hashlib
import threading

_lock = threading.Lock()
_results: dict[tuple, object] = {}
stats = {"compiles": 0, "reused": 0}


def install() -> bool:
    """Memoize JAX's Triton compile entry point (once); True where the hook exists."""
    try:
        from jax._src.lib import triton
    except ImportError:
        return False
    original = getattr(triton, "compile", None)
    if original is None or getattr(original, "memoized_by_specjax", False):
        return original is not None

    def compile(platform: str, module: bytes, arch_name: str, *, num_warps: int, num_ctas: int,
                num_stages: int):
        key = (platform.upper(), hashlib.sha256(module).hexdigest(), arch_name, num_warps, num_ctas, num_stages)
        with _lock:
            hit = _results.get(key)
        if hit is not None:
            stats["reused"] += 1
            return hit
        result = original(platform, module, arch_name, num_warps=num_warps, num_ctas=num_ctas,
                          num_stages=num_stages)
        with _lock:
            _results[key] = result
            stats["compiles"] += 1
        return result

    compile.memoized_by_specjax = True
    triton.compile = compile
    return True
