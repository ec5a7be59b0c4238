"""Roofline cost model for speculative decoding steps (pure JAX, jit + vmap over candidates)."""
