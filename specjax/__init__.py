"""specjax: lossless speculative decoding in JAX."""
