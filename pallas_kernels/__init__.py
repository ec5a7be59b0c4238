"""Pallas GPU kernels used by specjax (each kernel beside its pure-JAX reference)."""
