"""Pallas GPU kernels used by specjax (each kernel beside its pure-JAX reference)."""

from pallas_kernels.triton_compile_cache import install as _install_compile_cache

_install_compile_cache()  # one Triton compile per distinct kernel module (triton_compile_cache.py)
