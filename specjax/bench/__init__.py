"""`specjax bench`: the benchmark protocol on real prompt sets, lossless-gated (docs/design/bench.md)."""
