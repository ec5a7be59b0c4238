"""Build a drafter from its command-line spelling: `ngram`, `ngram:MAX_N`, `layerskip:K`, or a path
(or registry name) of a small model with the target's vocabulary."""

from __future__ import annotations

from specjax.drafters.model_drafter import layer_skip_drafter, small_model_drafter
from specjax.drafters.ngram import NgramDrafter
from specjax.errors import ConfigError

SUPPORTED = ("ngram", "ngram:MAX_N", "layerskip:K", "block:DIR (trained block drafter)",
             "block:random[:LAYERS] (untrained block drafter, block size k + 1)",
             "PATH (small AR model, same vocabulary)")


def _int_after(spec: str, what: str) -> int:
    try:
        return int(spec.split(":", 1)[1])
    except ValueError:
        raise ConfigError(f"drafter {spec!r}: {what} must be an integer") from None


def make_drafter(spec: str, target, k: int, dtype: str | None = None):
    """target: a LoadedModel. Returns a drafter pytree proposing k tokens per round."""
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    if spec == "ngram":
        return NgramDrafter(k=k)
    if spec.startswith("ngram:"):
        return NgramDrafter(k=k, max_n=_int_after(spec, "MAX_N"))
    if spec.startswith("block:random"):
        import jax

        from specjax.drafters.block import init_block_drafter
        layers = _int_after(spec[len("block:"):], "LAYERS") if spec.count(":") == 2 else 1
        return init_block_drafter(target.params, target.cfg, jax.random.PRNGKey(0), k + 1, layers)
    if spec.startswith("block:"):
        from specjax.drafters.block_train import load_block_drafter
        drafter = load_block_drafter(spec[len("block:"):], target.params, target.cfg)
        if drafter.k != k:
            raise ConfigError(f"drafter {spec}: trained with block size {drafter.block_size}, "
                              f"so --k must be {drafter.k}, got {k}")
        return drafter
    if spec.startswith("layerskip:"):
        return layer_skip_drafter(target.params, target.cfg, _int_after(spec, "K"), k)
    from specjax.models.loading import load_model  # a path or registry name
    small = load_model(spec, dtype=dtype or target.cfg.dtype)
    return small_model_drafter(small.params, small.cfg, target.cfg, k, name=spec)
