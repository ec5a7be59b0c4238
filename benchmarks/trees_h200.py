"""Tree verification on the device: verify-step time against node count for the dense 8B shape,
and tree vs chain vs plain decode for a hybrid (Gated DeltaNet 3 : 1 attention) ~8B shape.

    python benchmarks/trees_h200.py [--parts dense,hybrid] [--smoke]

A verify step here is what the engine runs per round minus the drafter: the target forward over
the N + 1 nodes (pending token + N drafted) under the tree's mask, the logits, the greedy
choice, and the commit of an accepted path (dense: K/V moved; hybrid: the path's tokens deferred,
and replayed into each GDN state at the head of the next step's forward). Each timing is R dependent steps inside one jit (the next step's tokens are this
step's choices), median of 3. Checks first: the tree GDN kernel against the XLA parallel form,
and the hybrid's tree and chain verify logits against each other on a chain. Writes
$OUT/trees_h200.json and prints a short table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.models.target import (chain_ancestors, init_target_cache, target_commit,  # noqa: E402
                                   target_forward, target_logits, target_verify, with_replay_width)
from specjax.search.kernel_timer import median_seconds  # noqa: E402
from specjax.trees.shape import TreeShape  # noqa: E402
from specjax.rounding import exact_jit  # noqa: E402

T0 = time.time()
RESULTS: dict = {"meta": {"jax": jax.__version__, "device": str(jax.devices()[0])}}
CONTEXT = 1024
DENSE_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192,
                dtype="bfloat16")
# Qwen3-Next's layer kinds and GDN heads at Llama-8B width, dense MLPs: ~8.7B parameters
HYBRID_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                 layer_types=tuple(("linear_attention",) * 3 + ("full_attention",)) * 8, num_heads=32,
                 num_kv_heads=8, head_dim=128, partial_rotary_factor=0.25, rope_theta=10000000.0,
                 rms_norm_eps=1e-6, linear_num_key_heads=16, linear_num_value_heads=32,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                 tie_word_embeddings=False, max_position_embeddings=8192, dtype="bfloat16")
NODES = [1, 8, 16, 32, 64]
HYBRID_NODES = [16, 32]
VARIANTS = ["xla", "pallas"]
DEPTH = 8  # tree depth for the budgets (the block drafters' k + 1)


DEADLINE = [float("inf")]  # --deadline-s: timings not started by then are skipped (results saved as they come)


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def in_time() -> bool:
    return time.time() - T0 < DEADLINE[0]


def save():
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "trees_h200.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def tree_inputs(shape: TreeShape, start: jax.Array, num_slots: int):
    """(mask [B, N, S]: the committed prefix and the node's ancestors, parents, ancestors)."""
    B, n = start.shape[0], shape.num_nodes
    parents = jnp.broadcast_to(jnp.asarray(shape.parents, jnp.int32), (B, n))
    anc = jnp.broadcast_to(jnp.asarray(shape.ancestors), (B, n, n))
    rel = jnp.arange(num_slots)[None, None, :] - start[:, None, None]
    in_tree = jnp.take_along_axis(anc, jnp.broadcast_to(jnp.clip(rel, 0, n - 1), (B, n, num_slots)), axis=2)
    return (rel < 0) | ((rel < n) & in_tree), parents, anc


def verify_loop(params, cfg, shape: TreeShape | None, chain_t: int = 0, reps: int = 8):
    """jit(cache, tokens) running `reps` dependent verify steps at a 1k context. shape: a tree;
    chain_t: a chain of that many tokens (causal mask, no K/V move); neither: AR steps (T = 1)."""
    B = 1
    cache = init_target_cache(cfg, B, CONTEXT + 128)
    start = jnp.full((B,), CONTEXT, jnp.int32)
    if shape is not None:
        n, depth = shape.num_nodes, shape.max_depth
        mask, parents, anc = tree_inputs(shape, start, cache.num_slots)
        positions = start[:, None] + jnp.asarray(shape.depths)[None, :]
        path = jnp.asarray(_deepest_path(shape))[None]
    else:
        n = max(chain_t, 1)
        depth = n - 1
        mask = None
        parents = jnp.broadcast_to(jnp.arange(-1, n - 1, dtype=jnp.int32), (B, n))
        anc = chain_ancestors(B, n)
        positions = start[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
        path = jnp.arange(n, dtype=jnp.int32)[None]
    accepted = jnp.full((B,), path.shape[1] - 1, jnp.int32)
    if shape is not None or chain_t:  # a hybrid cache defers each accepted path to the next forward
        cache = with_replay_width(params, cfg, cache, path.shape[1])

    def step(params, cache, tokens):
        if shape is None and chain_t == 0:  # plain decode
            hidden, _, cache = target_forward(params, cfg, tokens, positions, cache, start)
            return cache, jnp.argmax(target_logits(params, cfg, hidden), -1).astype(jnp.int32)
        hidden, _, cache, pending = target_verify(params, cfg, tokens, positions, cache, start, (), mask,
                                                  parents, anc, depth)
        choice = jnp.argmax(target_logits(params, cfg, hidden), -1).astype(jnp.int32)
        cache = target_commit(params, cfg, cache, pending, path, accepted, start, is_chain=shape is None)
        return cache, choice

    @exact_jit
    def run(params, cache, tokens):  # params an argument: closed over, 17 GB would become constants
        def body(_, carry):
            return step(params, *carry)
        return jax.lax.fori_loop(0, reps, body, (cache, tokens))[1]

    tokens = jnp.zeros((B, n), jnp.int32) + 7
    return run, cache, tokens


def _deepest_path(shape: TreeShape) -> np.ndarray:
    """Root to the first deepest node: the commit a fully accepted top-1 chain makes."""
    node = int(np.argmax(shape.depths))
    path = [node]
    while shape.parents[path[-1]] >= 0:
        path.append(shape.parents[path[-1]])
    return np.array(path[::-1], np.int32)


def timed_ms(params, cfg, shape=None, chain_t=0, reps=6) -> float:
    if not in_time():
        return float("nan")
    t = time.time()
    try:
        run, cache, tokens = verify_loop(params, cfg, shape, chain_t, reps)
        ms = median_seconds(run, params, cache, tokens, repeats=3) / reps * 1e3
    except Exception as e:  # noqa: BLE001 - recorded, the other timings still run
        log("  error:", repr(e)[:600])
        RESULTS.setdefault("errors", []).append(repr(e)[:2000])
        return float("nan")
    log(f"  {ms:.3f} ms ({time.time() - t:.0f} s with compile)", "tree" if shape else f"chain/AR T={chain_t}")
    return ms


def dense_part(smoke: bool) -> dict:
    from specjax.models.config import ModelConfig
    from specjax.models.kernel_params import prepare_kernel_params
    from specjax.models.params import init_random_params
    cfg = ModelConfig(**(SMOKE_DENSE if smoke else DENSE_8B))
    log("dense: init")
    params = init_random_params(cfg, jax.random.PRNGKey(0))
    variants = {"xla": params}
    if "pallas" in VARIANTS:
        variants["pallas"], _ = prepare_kernel_params(params, cfg, interpret=smoke)
    out = {"config": cfg.__dict__ | {"rope_scaling": None}, "context": CONTEXT, "depth": DEPTH}
    for name in VARIANTS:
        p = variants[name]
        row = {"AR_T1_ms": timed_ms(p, cfg)}
        out[name] = row
        for n in NODES:
            shape = TreeShape.for_budget(n, min(n, DEPTH))
            row[f"tree_N{n}_ms"] = timed_ms(p, cfg, shape)
            RESULTS["dense"] = out
            save()
        RESULTS["dense"] = out
        save()
    return out


def check_tree_kernel(interpret: bool) -> dict:
    """The Pallas tree GDN kernel against the XLA parallel form on a random 33-node tree."""
    from pallas_kernels.tree_gdn import tree_gdn
    from specjax.models.gdn_rule import normalize_qk
    from specjax.models.gdn_tree import gdn_tree_parallel
    rng = np.random.default_rng(0)
    parents = (-1,) + tuple(int(rng.integers(max(0, i - 3), i)) for i in range(1, 33))
    shape = TreeShape(parents)
    B, N, H, dk, dv = 1, 33, 4, 128, 128
    r = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    q, k = normalize_qk(r(B, N, H, dk), r(B, N, H, dk))
    v, state = r(B, N, H, dv), r(B, H, dk, dv)
    g = jnp.asarray(-rng.uniform(0.01, 1.0, (B, N, H)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (B, N, H)), jnp.float32)
    anc = jnp.asarray(shape.ancestors)[None]
    a = tree_gdn(state, q, k, v, g, beta, anc, shape.max_depth, interpret=interpret)
    b = gdn_tree_parallel(state, q, k, v, g, beta, anc, shape.max_depth)
    err = float(jnp.max(jnp.abs(a - b)))
    return {"max_abs_err": err, "max_abs_out": float(jnp.max(jnp.abs(b))), "ok": err < 1e-3}


def guarded(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)[:2000]}


def hybrid_part(smoke: bool) -> dict:
    from specjax.models.hybrid import init_random_hybrid_params
    from specjax.models.hybrid_config import HybridConfig
    cfg = HybridConfig(**(SMOKE_HYBRID if smoke else HYBRID_8B))
    log("hybrid: init")
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(1))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    out = {"config": dataclasses.asdict(cfg), "params": n_params, "context": CONTEXT}
    log("hybrid:", n_params, "parameters")
    if "pallas" in VARIANTS:
        out["tree_kernel_check"] = guarded(check_tree_kernel, smoke)
        log("tree kernel check", out["tree_kernel_check"])
    state_bytes = sum(s.nbytes for s in init_target_cache(cfg, 1, 8).state)
    conv_bytes = sum(s.nbytes for s in init_target_cache(cfg, 1, 8).conv)
    out["state_bytes"] = {"recurrent_state": state_bytes, "conv_windows": conv_bytes}
    kern = "interpret" if smoke else "pallas"
    variants = {"xla": params, "pallas": dataclasses.replace(params, kernels=kern)}
    for name in VARIANTS:
        p = variants[name]
        row = {"AR_T1_ms": timed_ms(p, cfg)}
        for n in HYBRID_NODES:
            shape = TreeShape.for_budget(n, min(n, DEPTH))
            row[f"tree_N{n}_ms"] = timed_ms(p, cfg, shape)
            row[f"chain_T{n + 1}_ms"] = timed_ms(p, cfg, chain_t=n + 1)
            row[f"{n}_decode_steps_ms"] = row["AR_T1_ms"] * n
            log("hybrid", name, n, {k: round(v, 3) for k, v in row.items()})
            out[name] = row
            RESULTS["hybrid"] = out
            save()
    out.update(memory_part(smoke))
    return out


def memory_part(smoke: bool) -> dict:
    """Per-request memory of the hybrid shape's tree verification, from shapes alone (abstract
    weights: runs anywhere): what a step keeps besides the one state, vs N per-position snapshots."""
    from specjax.models.hybrid import init_random_hybrid_params
    from specjax.models.hybrid_config import HybridConfig
    cfg = HybridConfig(**(SMOKE_HYBRID if smoke else HYBRID_8B))
    params = jax.eval_shape(lambda: init_random_hybrid_params(cfg, jax.random.PRNGKey(1)))
    cache = jax.eval_shape(lambda: init_target_cache(cfg, 1, 8))
    one = sum(x.size * x.dtype.itemsize for x in cache.state + cache.conv)
    out = {}
    for n in HYBRID_NODES:
        kept = guarded(deferred_bytes, cfg, params, TreeShape.for_budget(n, min(n, DEPTH)))
        out[f"N{n}_memory"] = {"one_state_and_windows_bytes": one, "kept_between_verify_and_commit_bytes": kept,
                               "snapshots_bytes": n * one, "ours_over_one_state": (one + kept) / one}
    return out


def deferred_bytes(cfg, params, shape: TreeShape) -> int:
    """Bytes a request holds beyond its states and K/V across a verify step: verify's `pending`
    (what the commit needs) and the cache's deferred-path buffer (tokens, length, start)."""
    cache = with_replay_width(params, cfg, init_target_cache(cfg, 1, CONTEXT + 128), shape.max_depth + 1)
    start = jnp.full((1,), CONTEXT, jnp.int32)
    mask, parents, anc = tree_inputs(shape, start, cache.num_slots)
    positions = start[:, None] + jnp.asarray(shape.depths)[None, :]
    tokens = jnp.zeros((1, shape.num_nodes), jnp.int32)
    pending = jax.eval_shape(lambda p, c: target_verify(p, cfg, tokens, positions, c, start, (), mask, parents,
                                                        anc, shape.max_depth)[3], params, cache)
    kept = [pending, cache.replay, cache.replay_len, cache.replay_start]
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(kept)))


SMOKE_DENSE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=4096, dtype="bfloat16")
SMOKE_HYBRID = dict(HYBRID_8B, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                    layer_types=("linear_attention",) * 3 + ("full_attention",), num_heads=4, num_kv_heads=2,
                    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16)


def main():
    global NODES, HYBRID_NODES, VARIANTS
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="dense,hybrid", help="any of dense, hybrid, memory (shapes only)")
    ap.add_argument("--variants", default="xla,pallas")
    ap.add_argument("--deadline-s", type=float, default=float("inf"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU check)")
    args = ap.parse_args()
    VARIANTS = args.variants.split(",")
    DEADLINE[0] = args.deadline_s
    if args.smoke:
        NODES, HYBRID_NODES = [1, 8], [8]
    parts = args.parts.split(",")
    for part in parts:
        RESULTS[part] = {"hybrid": hybrid_part, "dense": dense_part, "memory": memory_part}[part](args.smoke)
    save()
    print("\nverify step, ms (1k context, batch 1)")
    for part in ("dense", "hybrid"):
        for name in ("xla", "pallas"):
            row = RESULTS.get(part, {}).get(name)
            if isinstance(row, dict):
                print(f"{part:6s} {name:6s} " + " ".join(f"{k}={v:.3f}" for k, v in row.items()))
    for n in HYBRID_NODES:
        mem = RESULTS.get("hybrid", RESULTS.get("memory", {})).get(f"N{n}_memory")
        if mem:
            print(f"hybrid N={n}: state memory per request {mem['ours_over_one_state']:.6f}x one state "
                  f"(snapshots: {n}x)")


if __name__ == "__main__":
    main()
