"""Block-parallel drafter (DFlash-style): one non-causal forward over [pending, mask x (B - 1)]
proposes B - 1 drafts, conditioned on the target's hidden states injected as keys/values.

Design and data flow: docs/design/block_drafter.md. The target's embedding and LM head are the
target's own arrays (shared, not copied). The drafter state is its per-layer KV cache of injected
context, written by `observe` from the tapped hidden states of every target forward (prefill and
verify); only slots before the pending token are ever read, so rejected positions need no rollback.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.decoding.sequences import Sequences
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, init_cache, write_rows
from specjax.models.linear import linear
from specjax.models.params import LayerParams, ModelParams, init_random_params
from specjax.models.rope import apply_rope, rope_cos_sin
from specjax.models.transformer import _layer, lm_logits, rms_norm
from specjax.sampling import SamplingConfig, probabilities, sample_from


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockParams:
    """The drafter's own weights (the embedding and head are the target's)."""

    layers: list[LayerParams]  # the target's layer layout, at the drafter's sizes
    fc: jax.Array  # [len(taps) * D_target, D]: fuses the tapped hidden states
    fc_norm: jax.Array  # [D]
    mask_embed: jax.Array  # [D]: the input of every position after the pending token
    final_norm: jax.Array  # [D]
    conv: jax.Array | None = None  # [layers, 2 sublayers, 2 taps, D]: two-tap in-block convolution


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockDrafter:
    params: BlockParams
    embed: jax.Array  # the target's [V, D]
    lm_head: jax.Array | None  # the target's [D, V], None when tied to embed
    cfg: ModelConfig = dataclasses.field(metadata=dict(static=True))  # the drafter's layers
    taps: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # target layers, 0-based
    block_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def k(self) -> int:
        return self.block_size - 1

    # ---------------------------------------------------------------- context (observe)

    def init(self, prompt, prompt_len, num_slots, features=None):
        """features: the target's tapped hidden states over the prompt [B, P, len(taps) * D_t]."""
        if features is None:
            raise ConfigError("the block drafter needs the target's tapped hidden states at prefill")
        cache = init_cache(self.cfg, prompt.shape[0], num_slots)
        return self.observe(cache, features, jnp.zeros(prompt.shape[0], jnp.int32))

    def observe(self, cache: KVCache, features, start):
        """Write the context K/V of target positions start .. start + T - 1 into every layer."""
        cfg = self.cfg
        B, T, _ = features.shape
        ctx = rms_norm(linear(features.astype(self.params.fc.dtype), self.params.fc),
                       self.params.fc_norm, cfg.rms_norm_eps)
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        cos, sin = rope_cos_sin(cfg, positions)
        new_k, new_v = [], []
        for p, kc, vc in zip(self.params.layers, cache.k, cache.v):
            kv = ctx @ p.w_qkv[:, cfg.q_size:]
            if p.b_qkv is not None:
                kv = kv + p.b_qkv[cfg.q_size:]
            k, v = jnp.split(kv, 2, axis=-1)
            k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
            if p.k_norm is not None:
                k = rms_norm(k, p.k_norm, cfg.rms_norm_eps)
            new_k.append(write_rows(kc, apply_rope(k, cos, sin), start))
            new_v.append(write_rows(vc, v, start))
        return KVCache(k=new_k, v=new_v)

    # ---------------------------------------------------------------- drafting

    def block_logits(self, cache: KVCache, seqs: Sequences) -> jax.Array:
        """float32 logits [B, k, V] of the k positions after the pending token, in one forward."""
        return self.forward_block(cache, seqs.pending(), seqs.length - 1)

    def forward_block(self, cache: KVCache, pending, start) -> jax.Array:
        """pending [n] tokens at slots/positions start [n], context at slots < start -> [n, k, V].
        Training calls it with many anchors per sequence (cache rows repeated per anchor)."""
        cfg, bsz = self.cfg, self.block_size
        batch = start.shape[0]
        first = self.embed[pending][:, None, :]
        masks = jnp.broadcast_to(self.params.mask_embed.astype(first.dtype), (batch, bsz - 1, first.shape[-1]))
        x = jnp.concatenate([first, masks], axis=1)
        positions = start[:, None] + jnp.arange(bsz, dtype=jnp.int32)[None, :]
        cos, sin = rope_cos_sin(cfg, positions)
        # every block position sees the context (slots < start) and the whole block: non-causal
        visible = jnp.arange(cache.num_slots)[None, None, :] < (start + bsz)[:, None, None]
        mask = jnp.broadcast_to(visible, (batch, bsz, cache.num_slots))
        for i, (p, kc, vc) in enumerate(zip(self.params.layers, cache.k, cache.v)):
            mix = None if self.params.conv is None else _two_tap(self.params.conv[i])
            x, _, _ = _layer(cfg, p, x, cos, sin, kc, vc, start, mask, mix)  # block K/V dropped
        hidden = rms_norm(x[:, 1:], self.params.final_norm, cfg.rms_norm_eps)
        return lm_logits(self, hidden)

    def propose(self, cache, seqs: Sequences, key, sampling: SamplingConfig):
        logits = self.block_logits(cache, seqs)
        if sampling.greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None, cache
        # each position is drawn from its own q_i: a valid proposal for rejection sampling, which
        # needs only that q_i depend on what precedes draft i (here: the context alone)
        q = probabilities(logits, sampling)
        return sample_from(q, key), q, cache


def _two_tap(kernels):
    """kernels [2 sublayers, 2 taps, D] -> mix(h, sublayer): y_t = a * h_t + b * h_{t-1}, h_{-1} = 0."""
    def mix(h, sublayer):
        a, b = kernels[sublayer, 0].astype(h.dtype), kernels[sublayer, 1].astype(h.dtype)
        prev = jnp.pad(h[:, :-1], ((0, 0), (1, 0), (0, 0)))
        return a * h + b * prev
    return mix


# -------------------------------------------------------------------- construction

def drafter_config(target_cfg: ModelConfig, num_layers: int, intermediate_size: int | None = None
                   ) -> ModelConfig:
    """The drafter's layer config: the target's width, heads and RoPE (so the target's embedding,
    head and positions apply), its own depth and MLP width."""
    if num_layers < 1:
        raise ConfigError(f"block drafter: num_layers must be >= 1, got {num_layers}")
    if not isinstance(target_cfg, ModelConfig):  # a hybrid target: the drafter is a dense decoder
        target_cfg = ModelConfig(
            vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size,
            intermediate_size=target_cfg.intermediate_size, num_layers=num_layers,
            num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads,
            head_dim=target_cfg.head_dim, rms_norm_eps=target_cfg.rms_norm_eps,
            rope_theta=target_cfg.rope_theta, max_position_embeddings=target_cfg.max_position_embeddings,
            tie_word_embeddings=target_cfg.tie_word_embeddings, dtype=target_cfg.dtype)
    return dataclasses.replace(target_cfg, num_layers=num_layers,
                               intermediate_size=intermediate_size or target_cfg.intermediate_size)


def check_taps(taps, target_cfg: ModelConfig) -> tuple[int, ...]:
    taps = tuple(int(t) for t in taps)
    if not taps:
        raise ConfigError("block drafter: taps (target layers to condition on) must not be empty")
    bad = [t for t in taps if not 0 <= t < target_cfg.num_layers]
    if bad or len(set(taps)) != len(taps):
        raise ConfigError(f"block drafter: tapped layers {list(taps)} must be distinct and in "
                          f"0..{target_cfg.num_layers - 1} (the target's layers)")
    return taps


def default_taps(target_cfg: ModelConfig, count: int = 3) -> tuple[int, ...]:
    """`count` layers spread from the second to the second-to-last, as DFlash's configs do."""
    n = target_cfg.num_layers
    if n <= count:
        return tuple(range(n))
    lo, hi = min(1, n - 1), max(n - 2, 1)
    return tuple(sorted({round(lo + (hi - lo) * i / (count - 1)) for i in range(count)}))


def init_block_drafter(target: ModelParams, target_cfg: ModelConfig, key, block_size: int = 8,
                       num_layers: int = 2, taps=None, conv: bool = False,
                       intermediate_size: int | None = None, scale: float = 0.02) -> BlockDrafter:
    """A randomly initialized (untrained) block drafter for `target`."""
    if block_size < 2:
        raise ConfigError(f"block drafter: block_size must be >= 2 (1 pending + drafts), got {block_size}")
    taps = check_taps(default_taps(target_cfg) if taps is None else taps, target_cfg)
    cfg = drafter_config(target_cfg, num_layers, intermediate_size)
    k_layers, k_fc, k_mask = jax.random.split(key, 3)
    own = init_random_params(cfg, k_layers, scale=scale)
    D, dtype = cfg.hidden_size, jnp.dtype(cfg.dtype)
    fc = (scale * jax.random.normal(k_fc, (len(taps) * target_cfg.hidden_size, D))).astype(dtype)
    kernels = jnp.zeros((num_layers, 2, 2, D), dtype).at[:, :, 0].set(1.0) if conv else None  # identity
    params = BlockParams(layers=own.layers, fc=fc, fc_norm=jnp.ones(D, dtype),
                         mask_embed=(scale * jax.random.normal(k_mask, (D,))).astype(dtype),
                         final_norm=jnp.ones(D, dtype), conv=kernels)
    return BlockDrafter(params, target.embed, target.lm_head, cfg, taps, block_size)


def attach(params: BlockParams, target: ModelParams, target_cfg: ModelConfig, taps, block_size: int,
           name: str = "block drafter") -> BlockDrafter:
    """A block drafter from stored weights, checked against the target it will serve."""
    taps = check_taps(taps, target_cfg)
    D = target_cfg.hidden_size
    if params.fc.shape != (len(taps) * D, D):
        raise ConfigError(f"{name}: fc is {list(params.fc.shape)}, the target (hidden size {D}, "
                          f"{len(taps)} taps) needs {[len(taps) * D, D]}")
    if block_size < 2:
        raise ConfigError(f"{name}: block_size must be >= 2, got {block_size}")
    w = params.layers[0].w_gate_up
    cfg = drafter_config(target_cfg, len(params.layers), w.shape[1] // 2)
    return BlockDrafter(params, target.embed, target.lm_head, cfg, taps, block_size)
