"""The hybrid recurrent target (Qwen3-Next style): pure functions over `HybridParams` and a `HybridCache`.

Each layer is a token mixer, Gated DeltaNet (`gated_deltanet.py`) or gated attention, then a dense
SwiGLU MLP, both pre-normed and residual. `hybrid_forward` has `transformer.forward`'s contract: T new
tokens per row, attention K/V written at slots start .. start + T - 1 and read over all S slots under a
[B, T, S] mask (causal over slots by default); each GDN layer advances its recurrent state and conv
window over the T tokens in order.

Every RMSNorm except the GDN's gated one scales by (1 + weight), the weight stored as in the
checkpoint (its offset from 1), the sum formed in float32 (transformers' Qwen3NextRMSNorm).
Layers stay an unrolled Python list, as in the dense model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.gated_deltanet import GDNParams
from specjax.models.hybrid_tree import gdn_mixer, gdn_mixer_packed
from specjax.models.hybrid_config import HybridConfig
from specjax.models.kv_cache import write_rows
from specjax.models.linear import linear
from specjax.models.rope import apply_rope
from specjax.models.row_packing import pack_rows
from specjax.models.transformer import dense_attention, causal_slot_mask
from specjax.sharding.tp_hybrid import attention_kernel, paged_attention_kernel


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNLayerParams:
    in_norm: jax.Array  # [D] (1 + w)
    gdn: GDNParams
    mlp_norm: jax.Array  # [D] (1 + w)
    w_gate_up: jax.Array  # [D, 2 * F]
    w_down: jax.Array  # [F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttnLayerParams:
    in_norm: jax.Array  # [D] (1 + w)
    w_qgkv: jax.Array  # [D, 2 * q_size + 2 * kv_size]: columns query | output gate | key | value
    q_norm: jax.Array  # [head_dim] (1 + w)
    k_norm: jax.Array  # [head_dim] (1 + w)
    w_o: jax.Array  # [q_size, D]
    mlp_norm: jax.Array  # [D] (1 + w)
    w_gate_up: jax.Array  # [D, 2 * F]
    w_down: jax.Array  # [F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridParams:
    embed: jax.Array  # [V, D]
    layers: list[GDNLayerParams | AttnLayerParams]  # in layer order, kinds as cfg.layer_types
    final_norm: jax.Array  # [D] (1 + w)
    lm_head: jax.Array | None = None  # [D, V]; None when tied to `embed`
    # "xla", or the Pallas kernels for attention and tree verification of the GDN layers
    # ("pallas"; "interpret": Pallas interpret mode on a CPU)
    kernels: str = dataclasses.field(default="xla", metadata=dict(static=True))
    # a "tp" mesh the kernels run split over by heads (`sharding/tp_hybrid.py`); None: one device
    mesh: object = dataclasses.field(default=None, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridCache:
    k: list[jax.Array]  # per attention layer [B, S, Hkv, hd], slots as in kv_cache.py
    v: list[jax.Array]
    state: list[jax.Array]  # per GDN layer [B, Hv, dk, dv] float32
    conv: list[jax.Array]  # per GDN layer [B, K-1, conv_dim]: the last K-1 conv inputs
    # The last verify step's accepted path, committed (its K/V in place) but not yet in the GDN
    # states: the next forward replays it first, with the decode step's own function
    # (docs/design/hybrid.md). Width R = the longest path a step can accept (0: nothing deferred).
    replay: jax.Array  # [B, R] int32 tokens, at slots (= positions) replay_start + 0 .. R - 1
    replay_len: jax.Array  # [B] int32: how many of them are real (0: none)
    replay_start: jax.Array  # [B] int32
    # The serving engine's paged form (docs/design/serving_hybrid.md); None: the dense form above.
    # k/v are then the shared page pools [num_pages, page_size, Hkv, hd], slot s of row b lives at
    # offset s % page_size of page pages[b, s // page_size], and attention is the ragged paged
    # kernel (`paged`: "pallas", or "interpret" on a CPU).
    pages: jax.Array | None = None  # [B, P] int32 block table
    paged: str = dataclasses.field(default="", metadata=dict(static=True))

    @property
    def num_slots(self) -> int:
        if not self.k:
            return 0
        return self.k[0].shape[1] * (1 if self.pages is None else self.pages.shape[1])

    def replaced(self, **changes) -> "HybridCache":
        return dataclasses.replace(self, **changes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifiedNodes:
    """What a hybrid verify forward leaves behind (`pending`): the nodes' tokens, from which the
    commit takes the accepted path to defer, and each GDN layer's projected inputs of them
    (conv_in | b | a), from which a second verify level over later nodes of the same tree
    recomputes these nodes' part of the recurrence without running their layers again."""
    tokens: jax.Array  # [B, T] int32
    inputs: list[jax.Array]  # per GDN layer [B, T, conv_dim + 2 Hv]


def init_hybrid_cache(cfg: HybridConfig, batch: int, num_slots: int) -> HybridCache:
    dtype = jnp.dtype(cfg.dtype)
    kv = (batch, num_slots, cfg.num_kv_heads, cfg.head_dim)
    state = (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    conv = (batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
    n_attn, n_gdn = len(cfg.attn_layers), len(cfg.gdn_layers)
    zeros = jnp.zeros((batch,), jnp.int32)
    return HybridCache(k=[jnp.zeros(kv, dtype) for _ in range(n_attn)],
                       v=[jnp.zeros(kv, dtype) for _ in range(n_attn)],
                       state=[jnp.zeros(state, jnp.float32) for _ in range(n_gdn)],
                       conv=[jnp.zeros(conv, dtype) for _ in range(n_gdn)],
                       replay=jnp.zeros((batch, 0), jnp.int32), replay_len=zeros, replay_start=zeros)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3-Next's RMSNorm: normalize and scale by (1 + weight) in float32, then cast back."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def rope_cos_sin(cfg: HybridConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] -> cos, sin [B, T, rotary_dim] float32 for the partial RoPE (frequencies over
    rotary_dim, not head_dim; computed as `rope.py` does)."""
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv.astype(np.float32))
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first rotary_dim dims of x [B, T, H, hd] (rotate-half within them); pass the rest."""
    rd = cos.shape[-1]
    return jnp.concatenate([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], axis=-1)


def paged_rows(pool: jax.Array, pages: jax.Array, slots: jax.Array) -> jax.Array:
    """slots [B, T] of the rows of block table pages [B, P] -> their rows in the flattened pool
    [num_pages * page_size, ...]; a slot outside the table maps past the pool (a write drops it)."""
    page_size = pool.shape[1]
    inside = (slots >= 0) & (slots < pages.shape[1] * page_size)
    page = jnp.take_along_axis(pages, jnp.clip(slots // page_size, 0, pages.shape[1] - 1), axis=1)
    return jnp.where(inside, page * page_size + slots % page_size, pool.shape[0] * page_size)


def _write(buf: jax.Array, new: jax.Array, start: jax.Array, slots: jax.Array | None,
           pages: jax.Array | None = None) -> jax.Array:
    """new [B, T, ...] at slots start .. start + T - 1, or at explicit `slots` [B, T] (a slot past
    the buffer drops its row). pages: buf is a page pool read through this block table."""
    if pages is not None:
        if slots is None:
            slots = start[:, None] + jnp.arange(new.shape[1], dtype=jnp.int32)[None, :]
        flat = buf.reshape((-1,) + buf.shape[2:])
        rows = paged_rows(buf, pages, slots).reshape(-1)
        flat = flat.at[rows].set(new.reshape((-1,) + new.shape[2:]).astype(buf.dtype), mode="drop")
        return flat.reshape(buf.shape)
    if slots is None:
        return write_rows(buf, new, start)
    rows = jnp.arange(buf.shape[0])[:, None]
    return buf.at[rows, slots].set(new.astype(buf.dtype), mode="drop")


def _gated_attention(cfg: HybridConfig, p: AttnLayerParams, h, cos, sin, k_cache, v_cache, start, mask,
                     kernels: str = "xla", slots: jax.Array | None = None, kv_end: jax.Array | None = None,
                     mesh=None, paged: tuple | None = None):
    """h [B, T, D] (normed) -> (out [B, T, D], new caches). Output scaled by sigmoid(gate) per channel.
    slots: where each row's K/V goes (default: contiguous from start); kv_end [B]: no slot at or
    past it is visible (default start + T). paged: (block table, "pallas" | "interpret") when the
    caches are page pools (`HybridCache.pages`)."""
    gated, k_cache, v_cache = _attention_gated(cfg, p, linear(h, p.w_qgkv), cos, sin, k_cache, v_cache, start,
                                               mask, kernels, slots, kv_end, mesh, paged)
    return linear(gated, p.w_o), k_cache, v_cache


def _attention_gated(cfg: HybridConfig, p: AttnLayerParams, qgkv, cos, sin, k_cache, v_cache, start, mask,
                     kernels: str, slots, kv_end, mesh=None, paged: tuple | None = None):
    """`_gated_attention` between its two GEMMs: qgkv [B, T, w_qgkv columns] -> (attention output
    times sigmoid(gate) [B, T, q_size], new caches)."""
    B, T, _ = qgkv.shape
    q, gate, k, v = jnp.split(qgkv, [cfg.q_size, 2 * cfg.q_size, 2 * cfg.q_size + cfg.kv_size], axis=-1)
    q = rms_norm(q.reshape(B, T, cfg.num_heads, cfg.head_dim), p.q_norm, cfg.rms_norm_eps)
    k = rms_norm(k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim), p.k_norm, cfg.rms_norm_eps)
    v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    q = apply_partial_rope(q, cos, sin)
    k = apply_partial_rope(k, cos, sin)
    pages = None if paged is None else paged[0]
    k_cache = _write(k_cache, k, start, slots, pages)
    v_cache = _write(v_cache, v, start, slots, pages)
    if paged is not None:  # the ragged paged kernel reads the pools in place, masked as below
        end = start + q.shape[1] if kv_end is None else kv_end
        mixed = paged_attention_kernel(q, k_cache, v_cache, pages, mask, end, paged[1] == "interpret", mesh)
    elif kernels == "xla":
        mixed = dense_attention(cfg, q, k_cache, v_cache, mask)  # reads num_heads, num_kv_heads, head_dim, q_size
    else:  # the fused kernel (any mask: causal or a tree's)
        end = start + q.shape[1] if kv_end is None else kv_end
        mixed = attention_kernel(q, k_cache, v_cache, mask, end, kernels == "interpret", mesh)
    return mixed * jax.nn.sigmoid(gate), k_cache, v_cache


def _mlp(p: GDNLayerParams | AttnLayerParams, h: jax.Array) -> jax.Array:
    gate, up = jnp.split(linear(h, p.w_gate_up), 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, p.w_down)


def hybrid_forward(params: HybridParams, cfg: HybridConfig, tokens: jax.Array, positions: jax.Array,
                   cache: HybridCache, start: jax.Array, mask: jax.Array | None = None
                   ) -> tuple[jax.Array, HybridCache]:
    """tokens/positions [B, T] int32, start [B] int32 -> (final-normed hidden [B, T, D], new cache).
    `mask` [B, T, S] applies to the attention layers only; GDN layers run the T tokens as a chain."""
    hidden, _, cache, _ = hybrid_run(params, cfg, tokens, positions, cache, start, mask)
    return hidden, cache


def hybrid_run(params: HybridParams, cfg: HybridConfig, tokens: jax.Array, positions: jax.Array,
               cache: HybridCache, start: jax.Array, mask: jax.Array | None = None,
               valid: jax.Array | None = None, taps: tuple[int, ...] = (), tree=None, pack=None,
               prefix: VerifiedNodes | None = None):
    """`hybrid_forward` with the engine's options -> (hidden, features, cache, pending).

    valid [B]: each row's real tokens (the rest, right-padding, never reaches a GDN state).
    taps: layers whose output residual stream is returned, joined along features (block drafters).
    tree: (parents [B, T], ancestors [B, T, T], depth) to verify T tree nodes: GDN layers compute
    every node's output from the state (`hybrid_tree.py`) and do not advance over them; `pending`
    is then a `VerifiedNodes`, from which `target_commit` takes the accepted path to replay.
    prefix: the `pending` of a verify of the tree's first nodes on this cache (two-level
    verification): the T tokens are the tree's later nodes (tree: the whole tree, prefix's nodes
    first; start: the first later node's slot), and the returned pending covers the whole tree.

    A deferred path in the cache (`HybridCache.replay`, R rows) runs first, as rows ahead of the
    T tokens: its K/V are rewritten at their own slots, and each GDN layer advances its state and
    window over it one token per `gdn_advance` call (plain decoding's step) before the T tokens
    see the state. Its rows are dropped from what is returned.

    pack: (counts [B], bucket) with a tree: run only each row's first counts[b] tokens and its
    deferred path, packed into one flat bucket of B R + bucket tokens for every row-wise op
    (`row_packing.py`; the serving engine's packed verification). bucket (static) >= sum(counts).
    The returned hidden rows past a row's count are filler (finite, never to be read)."""
    if pack is not None and tree is None:
        raise ValueError("packed rows need the tree form of the GDN layers (chain_verify passes it)")
    T, R, S = tokens.shape[1], cache.replay.shape[1], cache.num_slots
    if mask is None:
        mask = causal_slot_mask(start, T, S)
    slots = kv_end = None
    replay_len = cache.replay_len
    if pack is not None:  # rows with a count of 0 run nothing, their deferred path included
        replay_len = jnp.where(pack[0] > 0, replay_len, 0)
    if R:
        r_slots = cache.replay_start[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :]  # [B, R]
        r_live = jnp.arange(R)[None, :] < replay_len[:, None]
        r_mask = jnp.arange(S)[None, None, :] <= r_slots[:, :, None]  # causal; the path precedes start
        slots = jnp.concatenate([jnp.where(r_live, r_slots, S),  # S: the row writes nothing
                                 start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]], axis=1)
        tokens = jnp.concatenate([cache.replay, tokens], axis=1)
        positions = jnp.concatenate([r_slots, positions], axis=1)
        mask = jnp.concatenate([r_mask, mask], axis=1)
        kv_end = start + T
    packing = None
    if pack is not None:
        counts, bucket = pack
        cols = jnp.arange(R + T)[None, :]
        # after a prefix's verify nothing is deferred (that forward replayed the path): no room for it
        replayed = replay_len[:, None] if prefix is None else 0
        live = jnp.where(cols < R, cols < replayed, cols - R < counts[:, None]) & (counts[:, None] > 0)
        packing = pack_rows(live, (tokens.shape[0] * R if prefix is None else 0) + bucket)
    to_rows = (lambda y: y) if packing is None else packing.to_rows
    to_flat = (lambda y: y) if packing is None else packing.to_flat
    x = params.embed[to_flat(tokens)]  # [B, R + T, D], or the live tokens [1, N, D] packed
    cos, sin = rope_cos_sin(cfg, positions)
    new = cache.replaced(k=list(cache.k), v=list(cache.v), state=list(cache.state), conv=list(cache.conv),
                         replay_len=jnp.zeros_like(cache.replay_len))
    paged = None if cache.pages is None else (cache.pages, cache.paged)
    attn_index = {layer: n for n, layer in enumerate(cfg.attn_layers)}
    gdn_index = {layer: n for n, layer in enumerate(cfg.gdn_layers)}
    tapped, inputs = {}, {}

    def earlier(n):  # the prefix nodes' inputs to GDN layer n
        return None if prefix is None else prefix.inputs[n]
    for i, p in enumerate(params.layers):
        h = rms_norm(x, p.in_norm, cfg.rms_norm_eps)
        if i in attn_index:
            n = attn_index[i]
            if packing is None:
                out, new.k[n], new.v[n] = _gated_attention(cfg, p, h, cos, sin, new.k[n], new.v[n], start, mask,
                                                           params.kernels, slots, kv_end, params.mesh, paged)
            else:  # the GEMMs on the bucket, attention over the rows
                gated, new.k[n], new.v[n] = _attention_gated(cfg, p, to_rows(linear(h, p.w_qgkv)), cos, sin,
                                                             new.k[n], new.v[n], start, mask, params.kernels, slots,
                                                             kv_end, params.mesh, paged)
                out = linear(to_flat(gated), p.w_o)
        else:
            n = gdn_index[i]
            if packing is None:
                out, new.state[n], new.conv[n], inputs[n] = gdn_mixer(
                    p.gdn, cfg, h, new.state[n], new.conv[n], R, replay_len, tree, valid, params.kernels,
                    params.mesh, earlier(n))
            else:
                out, new.state[n], new.conv[n], inputs[n] = gdn_mixer_packed(
                    p.gdn, cfg, h, new.state[n], new.conv[n], R, replay_len, tree, params.kernels, packing,
                    params.mesh, earlier(n))
        x = x + out
        x = x + _mlp(p, rms_norm(x, p.mlp_norm, cfg.rms_norm_eps))
        if i in taps:
            tapped[i] = to_rows(x)[:, R:]
    features = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
    pending = None
    if tree is not None:
        pending = VerifiedNodes(tokens[:, R:], [inputs[n] for n in range(len(cfg.gdn_layers))])
        if prefix is not None:
            pending = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), prefix, pending)
    return to_rows(rms_norm(x, params.final_norm, cfg.rms_norm_eps))[:, R:], features, new, pending


def hybrid_logits(params: HybridParams, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V]."""
    head = params.embed.T if params.lm_head is None else params.lm_head
    return jnp.matmul(hidden, head, preferred_element_type=jnp.float32)


def init_random_hybrid_params(cfg: HybridConfig, key: jax.Array, scale: float = 0.02) -> HybridParams:
    """Random weights for tests and benchmarks: matrices normal * scale, (1 + w) norm offsets near 0,
    gated-norm scales near 1. Decay rates A are drawn from [0.05, 1] (transformers' init goes up to 16,
    which forgets nearly everything each token) so the recurrent state matters across tokens."""
    dtype = jnp.dtype(cfg.dtype)
    D, F, V, Hv = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.linear_num_value_heads
    keys = iter(jax.random.split(key, 12 * cfg.num_layers + 3))

    def normal(shape, s=scale):
        return (s * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def offset_norm(n):  # (1 + w) norms
        return normal((n,), 0.1)

    def mlp():
        return dict(mlp_norm=offset_norm(D), w_gate_up=normal((D, 2 * F)), w_down=normal((F, D)))

    layers = []
    for kind in cfg.layer_types:
        if kind == "full_attention":
            layers.append(AttnLayerParams(
                in_norm=offset_norm(D), w_qgkv=normal((D, 2 * cfg.q_size + 2 * cfg.kv_size)),
                q_norm=offset_norm(cfg.head_dim), k_norm=offset_norm(cfg.head_dim),
                w_o=normal((cfg.q_size, D)), **mlp()))
        else:
            A = jax.random.uniform(next(keys), (Hv,), jnp.float32, 0.05, 1.0)
            gdn = GDNParams(
                w_in=normal((D, cfg.in_proj_size)),
                conv_w=normal((cfg.linear_conv_kernel_dim, cfg.conv_dim), 0.3),
                A_log=jnp.log(A).astype(dtype), dt_bias=normal((Hv,), 0.5),
                norm=(1.0 + normal((cfg.linear_value_head_dim,), 0.1)).astype(dtype),
                w_out=normal((cfg.value_dim, D)))
            layers.append(GDNLayerParams(in_norm=offset_norm(D), gdn=gdn, **mlp()))
    return HybridParams(embed=normal((V, D)), layers=layers, final_norm=offset_norm(D),
                        lm_head=None if cfg.tie_word_embeddings else normal((D, V)))
