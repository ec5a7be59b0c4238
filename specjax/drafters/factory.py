"""Build a drafter from its command-line spelling: `ngram`, `ngram:MAX_N`, `layerskip:K`, or a path
(or registry name) of a small model with the target's vocabulary."""

from __future__ import annotations

from specjax.drafters.model_drafter import layer_skip_drafter, small_model_drafter
from specjax.drafters.ngram import NgramDrafter
from specjax.errors import ConfigError

SUPPORTED = ("ngram", "ngram:MAX_N", "layerskip:K", "PATH (small AR model, same vocabulary)")


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
    if spec.startswith("layerskip:"):
        return layer_skip_drafter(target.params, target.cfg, _int_after(spec, "K"), k)
    from specjax.models.loading import load_model  # a path or registry name
    small = load_model(spec, dtype=dtype or target.cfg.dtype)
    return small_model_drafter(small.params, small.cfg, target.cfg, k, name=spec)
