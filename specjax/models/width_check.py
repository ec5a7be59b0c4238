"""Width invariance: does a verify step over W tokens compute, bit for bit, what W AR steps compute?

Speculative decoding is token-exact only if it does: the target's logits at a position must not
depend on how many positions the step processed. `step_vs_ar` compares the residual stream after
every layer and the logits, row by row; `ops_vs_width` checks the step's ops in isolation.
On the kernel path (skinny GEMMs, fused attention) both must report no difference; XLA's bf16
GEMMs do not promise it (benchmarks/exactness_h200.py runs this on a device).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax.models.kv_cache import init_cache
from specjax.models.transformer import TreeMask, forward, forward_with_taps, lm_logits, rms_norm
from specjax.rounding import exact_jit


def bits(x) -> np.ndarray:
    x = np.asarray(jnp.asarray(x, jnp.float32))
    return x.view(np.uint32)


def step_vs_ar(params, cfg, width: int, prompt_len: int = 64, batch: int = 1) -> dict:
    """Residual stream after each layer (and logits): verify over `width` tokens vs AR steps, for
    `batch` rows at once (rows of one call are where XLA's reduction order can shift: a norm over
    2 x 5 rows need not round like one over 2 x 1). Per position j: the first layer where any row
    differs (None: none), and whether every row's logits / argmax are equal."""
    taps = tuple(range(cfg.num_layers))
    slots = -(-(prompt_len + width + 8) // 64) * 64
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
    new = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, width)), jnp.int32)
    fwd = exact_jit(forward_with_taps, static_argnames=("cfg", "taps"))
    zeros = jnp.zeros(batch, jnp.int32)
    _, _, cache = fwd(params, cfg, prompt, jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len)),
                      init_cache(cfg, batch, slots), zeros)
    start = jnp.full(batch, prompt_len, jnp.int32)
    hv, fv, _ = fwd(params, cfg, new, start[:, None] + jnp.arange(width)[None], cache, start, taps=taps)
    lv = lm_logits(params, hv)
    rows = []
    c = cache
    for j in range(width):
        h, f, c = fwd(params, cfg, new[:, j:j + 1], start[:, None] + j, c, start + j, taps=taps)
        rows.append((f, lm_logits(params, h)))
    D = cfg.hidden_size
    out = {"first_layer_differing": [], "logits_equal": [], "argmax_equal": []}
    for j, (f, lg) in enumerate(rows):
        differ = [li for li in range(cfg.num_layers)
                  if not np.array_equal(bits(fv[:, j, li * D:(li + 1) * D]), bits(f[:, 0, li * D:(li + 1) * D]))]
        out["first_layer_differing"].append(differ[0] if differ else None)
        out["logits_equal"].append(bool(np.array_equal(bits(lv[:, j]), bits(lg[:, 0]))))
        out["argmax_equal"].append(bool(jnp.all(jnp.argmax(lv[:, j], -1) == jnp.argmax(lg[:, 0], -1))))
    return out


def tree_vs_ar(params, cfg, nodes: int, prompt_len: int = 64, batch: int = 1, seed: int = 0) -> dict:
    """A tree verify step over a random tree of `nodes` nodes per row vs the AR steps that decode
    each node's path from the same prefix: per node, whether every row's logits are equal bit for
    bit, under the `TreeMask` (the engine's path: on the kernels, tree_attention.py) and under the
    plain dense tree mask (decode_attention.py pairing terms by node slot)."""
    from specjax.trees.tree import Tree
    from specjax.trees.verify import tree_mask
    rng = np.random.default_rng(seed)
    slots = -(-(prompt_len + nodes + 8) // 64) * 64
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
    fwd = exact_jit(forward, static_argnames=("cfg",))
    _, cache = fwd(params, cfg, prompt, jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len)),
                   init_cache(cfg, batch, slots), jnp.zeros(batch, jnp.int32))
    parents = np.full((batch, nodes), -1, np.int32)
    for i in range(1, nodes):
        parents[:, i] = rng.integers(0, i, batch)
    tree = Tree(tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, nodes)), jnp.int32),
                parents=jnp.asarray(parents), max_depth=nodes - 1)
    anc = tree.ancestors()
    depths = tree.depths(anc)
    start = jnp.full(batch, prompt_len, jnp.int32)
    dense = tree_mask(tree, start, slots, anc)
    pos = start[:, None] + depths
    logits = {name: np.asarray(lm_logits(params, fwd(params, cfg, tree.tokens, pos, cache, start, mask)[0]))
              for name, mask in (("tree_mask", TreeMask(dense, anc, depths, nodes - 1)), ("dense_mask", dense))}
    equal = {name: [] for name in logits}
    anc_np, depths_np = np.asarray(anc), np.asarray(depths)
    for i in range(nodes):
        # AR over each row's path to node i (rows' paths differ in tokens, not in length order)
        depth = depths_np[:, i]
        c, last = cache, np.zeros_like(logits["tree_mask"][:, 0])
        paths = [[j for j in range(nodes) if anc_np[r, i, j]] for r in range(batch)]  # root first
        for d in range(int(depth.max()) + 1):
            idx = jnp.asarray([p[min(d, len(p) - 1)] for p in paths], jnp.int32)
            tok = jnp.take_along_axis(tree.tokens, idx[:, None], axis=1)
            h, c = fwd(params, cfg, tok, start[:, None] + d, c, start + d)
            lg = np.asarray(lm_logits(params, h))[:, 0]
            done = depth == d
            last[done] = lg[done]
        for name in logits:
            equal[name].append(bool(np.array_equal(bits(last), bits(logits[name][:, i]))))
    return {"depths": depths_np.tolist(), "logits_equal": equal}


def norm_vs_rows(params, cfg, width: int, batch: int = 2, draws: int = 40) -> dict:
    """Draws (of `draws`) in which a row's RMSNorm differs, bitwise, between a [batch, 1, D] and a
    [batch, width, D] call: for the model's norm (`params.norm`) and for XLA's, side by side. In
    float32, so that every change of the sum's order shows (a bf16 output rounds most away, and
    the rest flips a token now and then)."""
    rng = np.random.default_rng(2)
    w = params.layers[0].attn_norm.astype(jnp.float32)
    impls = {"model": params.norm, "xla": "xla"}
    fns = {k: exact_jit(lambda x, impl=impl: rms_norm(x, w, cfg.rms_norm_eps, impl)) for k, impl in impls.items()}
    differs = dict.fromkeys(impls, 0)
    for _ in range(draws):
        x = jnp.asarray(rng.normal(0, 3, (batch, width, cfg.hidden_size)), jnp.float32)
        for k, f in fns.items():
            differs[k] += not np.array_equal(bits(f(x[:, :1])[:, 0]), bits(f(x)[:, 0]))
    return {"draws": draws, "batch": batch, "width": width, "norm_impl": params.norm,
            "differing_draws": differs}


def ops_vs_width(params, cfg, width: int) -> dict:
    """Each op of a layer at width W vs width 1 on the same rows (bitwise)."""
    from specjax.models.linear import linear
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(0, 1, (1, width, cfg.hidden_size)), jnp.bfloat16)
    layer = params.layers[0]
    from specjax.models.rope import apply_rope, rope_cos_sin

    def rope(x):  # positions 100 + j at width W; position 100 + j alone at width 1
        pos = 100 + jnp.arange(x.shape[1], dtype=jnp.int32)[None]
        return apply_rope(x.reshape(1, x.shape[1], -1, cfg.head_dim), *rope_cos_sin(cfg, pos))

    ops = {
        "rms_norm": exact_jit(lambda x: rms_norm(x, layer.attn_norm, cfg.rms_norm_eps, params.norm)),
        "w_qkv": exact_jit(lambda x: linear(x, layer.w_qkv)),
        "w_gate_up": exact_jit(lambda x: linear(x, layer.w_gate_up)),
        "lm_head": exact_jit(lambda x: lm_logits(params, x)),
    }
    out = {}
    for name, f in ops.items():
        wide = f(x)
        out[name] = all(np.array_equal(bits(wide[:, j]), bits(f(x[:, j:j + 1])[:, 0])) for j in range(width))
    # RoPE: row j of a width-W call sits at position 100 + j, so compare with a width-1 call there
    wide = exact_jit(rope)(x)
    one = exact_jit(lambda x, p: apply_rope(x.reshape(1, 1, -1, cfg.head_dim),
                                          *rope_cos_sin(cfg, jnp.full((1, 1), p, jnp.int32))))
    out["rope"] = all(np.array_equal(bits(wide[:, j]), bits(one(x[:, j:j + 1], 100 + j)[:, 0])) for j in range(width))
    return out
