"""Multi-device placement (tensor parallelism through jax.sharding)."""
