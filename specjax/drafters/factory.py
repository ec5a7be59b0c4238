"""Build a drafter from its command-line spelling: `ngram`, `ngram:MAX_N`, `layerskip:K`, a block
drafter (`block`: the shipped trained one for the target at block size k + 1; `block:trained:LAYERS`;
`block:DIR|FILE`; `block:random[:LAYERS]`), acceptance replay (`replay:PROFILE:LAYERS`, needs the
prompts), or a path (or registry name) of a small model with the target's vocabulary."""

from __future__ import annotations

from specjax.drafters.model_drafter import layer_skip_drafter, small_model_drafter
from specjax.drafters.ngram import NgramDrafter
from specjax.errors import ConfigError

SUPPORTED = ("ngram", "ngram:MAX_N", "layerskip:K",
             "block (the shipped trained block drafter for the target, block size k + 1)",
             "block:trained:LAYERS (the same, checked to have LAYERS layers)",
             "block:DIR|FILE.safetensors (a block drafter from train-drafter)",
             "block:random[:LAYERS] (untrained block drafter, block size k + 1)",
             "replay:PROFILE:LAYERS (acceptance replay, greedy, a LAYERS-layer block network)",
             "PATH (small AR model, same vocabulary)")


def _int_after(spec: str, what: str) -> int:
    try:
        return int(spec.split(":", 1)[1])
    except ValueError:
        raise ConfigError(f"drafter {spec!r}: {what} must be an integer") from None


def _trained_block(target, k: int, layers: int | None):
    from specjax.drafters import trained
    from specjax.drafters.block_train import load_block_drafter
    path = trained.drafter_path(target.name, k + 1)
    drafter = load_block_drafter(path, target.params, target.cfg)
    if layers is not None and len(drafter.params.layers) != layers:
        raise ConfigError(f"drafter block:trained:{layers}: the trained drafter {path.name} has "
                          f"{len(drafter.params.layers)} layers")
    return drafter


def _replay(spec: str, target, k: int, prompts, max_new_tokens):
    import jax

    from specjax.drafters import trained
    from specjax.drafters.block import init_block_drafter
    from specjax.drafters.replay import fit_profile, load_profile, replay_drafter
    parts = spec.split(":")
    if len(parts) != 3:
        raise ConfigError(f"drafter {spec!r}: spell it replay:PROFILE:LAYERS")
    layers = _int_after(f"x:{parts[2]}", "LAYERS")
    if prompts is None or max_new_tokens is None:
        raise ConfigError(f"drafter {spec!r}: acceptance replay replays the target's continuations of "
                          "known prompts; build it with the prompts (search, generate)")
    alpha = fit_profile(load_profile(trained.profile_path(parts[1])), k)
    inner = init_block_drafter(target.params, target.cfg, jax.random.PRNGKey(0), k + 1, layers)
    return replay_drafter(inner, target.cfg, target.params, prompts, max_new_tokens, alpha)


def make_drafter(spec: str, target, k: int, dtype: str | None = None, prompts=None,
                 max_new_tokens: int | None = None):
    """target: a LoadedModel. Returns a drafter pytree proposing k tokens per round. `prompts` and
    `max_new_tokens`: the run's, for acceptance replay."""
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    if spec == "block":
        return _trained_block(target, k, None)
    if spec.startswith("block:trained"):
        return _trained_block(target, k, _int_after(spec[len("block:"):], "LAYERS"))
    if spec.startswith("replay:"):
        return _replay(spec, target, k, prompts, max_new_tokens)
    if spec == "ngram":  # the vocabulary size lets it score tree alternatives
        return NgramDrafter(k=k, vocab_size=target.cfg.vocab_size)
    if spec.startswith("ngram:"):
        return NgramDrafter(k=k, max_n=_int_after(spec, "MAX_N"), vocab_size=target.cfg.vocab_size)
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
