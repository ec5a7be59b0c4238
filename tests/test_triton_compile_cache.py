"""The Triton compile memo (pallas_kernels/triton_compile_cache.py): JAX's compile entry point,
called twice with one module, compiles once; another module, or other launch settings, compile
again; results are the compiler's own. A fake compilation handler stands in for the GPU's."""

from __future__ import annotations

import pytest

import pallas_kernels  # noqa: F401  (installs the memo)
from pallas_kernels import triton_compile_cache as tcc


def test_one_compile_per_distinct_module():
    triton = pytest.importorskip("jax._src.lib.triton")
    assert tcc.install() and triton.compile.memoized_by_specjax
    calls = []

    def fake(module, arch, num_warps, num_ctas, num_stages):
        calls.append((module, num_warps))
        return ("compiled", module, arch, num_warps, num_ctas, num_stages)
    try:
        triton.register_compilation_handler("specjaxtest", fake)
    except RuntimeError:
        pass  # already registered by an earlier run in this process
    kw = dict(num_warps=4, num_ctas=1, num_stages=3)
    first = triton.compile("specjaxtest", b"module-a", "9.0", **kw)
    again = triton.compile("specjaxtest", b"module-a", "9.0", **kw)
    assert again is first and first == ("compiled", b"module-a", "9.0", 4, 1, 3)
    other = triton.compile("specjaxtest", b"module-b", "9.0", **kw)
    warps = triton.compile("specjaxtest", b"module-a", "9.0", num_warps=8, num_ctas=1, num_stages=3)
    assert other[1] == b"module-b" and warps[3] == 8
    assert [c for c in calls if c[0].startswith(b"module-")] == [(b"module-a", 4), (b"module-b", 4), (b"module-a", 8)]
    assert tcc.install()  # installing again keeps the one memo
