"""Tensor-parallel cases, run by test_tensor_parallel.py in a process with 4 virtual CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before jax starts). Each case
compares the sharded engine with the unsharded one: greedy tokens equal, token forcing passes."""

from __future__ import annotations

import dataclasses
import sys

import jax
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

from specjax.decoding.sequences import GenerationConfig  # noqa: E402
from specjax.drafters.block import init_block_drafter  # noqa: E402
from specjax.drafters.model_drafter import small_model_drafter  # noqa: E402
from specjax.drafters.ngram import NgramDrafter  # noqa: E402
from specjax.engine import Decoder  # noqa: E402
from specjax.forcing import check_token_forcing  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.hybrid import init_random_hybrid_params  # noqa: E402
from specjax.models.hybrid_config import HybridConfig  # noqa: E402
from specjax.models.params import init_random_params  # noqa: E402
from specjax.sharding.tp import TP_AXIS, tp_mesh  # noqa: E402
from specjax.trees.builders import TreeSpec  # noqa: E402

TOL = 1e-4


def prompts_for(rng, vocab, count=3):
    out = []
    for _ in range(count):
        motif = rng.integers(3, vocab, int(rng.integers(3, 7))).tolist()
        out.append((motif * 4)[: int(rng.integers(8, 20))])
    return out


def check(name, decoder, prompts, reference):
    report = check_token_forcing(decoder, prompts, reference, tolerance=TOL)
    assert report.passed, f"{name}: {report.summary()}"
    free = decoder.generate(prompts)
    if all(min(m, default=np.inf) >= TOL for m in reference.margins):
        assert free.tokens == reference.tokens, f"{name}: free-running tokens differ"
    print(f"ok {name}: {report.summary()}")


def dense(seed: int, tp: int):
    rng = np.random.default_rng(seed)
    kv = int(rng.choice([2, 4]))
    cfg = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=kv * int(rng.choice([1, 2])), num_kv_heads=kv, head_dim=8,
                      tie_word_embeddings=bool(rng.integers(0, 2)), qk_norm=bool(rng.integers(0, 2)),
                      max_position_embeddings=256)
    params = init_random_params(cfg, jax.random.PRNGKey(seed), scale=0.5)
    prompts = prompts_for(rng, cfg.vocab_size)
    gen = GenerationConfig(max_new_tokens=16)
    mesh = tp_mesh(tp)
    reference = Decoder(cfg, params, gen).generate(prompts)
    sharded_ar = Decoder(cfg, params, gen, mesh=mesh)
    w = sharded_ar.params.layers[0].w_qkv
    assert w.sharding.spec[1] == TP_AXIS and len(w.sharding.device_set) == tp, w.sharding
    assert sharded_ar.shard_report.sharded
    got = sharded_ar.generate(prompts)
    if all(min(m, default=np.inf) >= TOL for m in reference.margins):
        assert got.tokens == reference.tokens, f"dense seed {seed} tp {tp}: AR tokens differ"
    print(f"ok dense AR seed {seed} tp {tp}")
    block = init_block_drafter(params, cfg, jax.random.PRNGKey(seed + 1), 5, 1)
    dcfg = ModelConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=8, max_position_embeddings=256)
    small = small_model_drafter(init_random_params(dcfg, jax.random.PRNGKey(seed + 2), 0.3), dcfg, cfg, k=3)
    for label, drafter, tree, shard in (("ngram", NgramDrafter(k=4), None, False),
                                        ("block", block, None, True),
                                        ("block tree 8", block, TreeSpec.budget("best_first", 8, 4), False),
                                        ("small AR drafter", small, None, False)):
        dec = Decoder(cfg, params, gen, drafter=drafter, tree=tree, mesh=mesh, shard_drafter=shard)
        check(f"dense seed {seed} tp {tp} {label}", dec, prompts, reference)


def serving(seed: int, tp: int):
    """The continuous-batching engine with every mechanism on, target split over tp devices:
    token forcing per request against the unsharded AR."""
    from specjax.serving import ServingEngine, ServingOptions
    from specjax.serving.forcing import check_serving_forcing
    rng = np.random.default_rng(seed)
    cfg = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=8,
                      num_kv_heads=4, head_dim=8, max_position_embeddings=256)
    params = init_random_params(cfg, jax.random.PRNGKey(seed), scale=0.5)
    prompts = prompts_for(rng, cfg.vocab_size, count=5)
    reference = Decoder(cfg, params, GenerationConfig(max_new_tokens=12)).generate(prompts)
    block = init_block_drafter(params, cfg, jax.random.PRNGKey(seed + 1), 4, 1)
    for label, drafter, opts in (
            ("ngram, budget + packed + device loop + two-level", NgramDrafter(k=4),
             ServingOptions(budget=6, packed=True, steps_per_call=4, two_level_k1=2)),
            ("block, padded host loop", block, ServingOptions()),
            ("ngram trees, packed, paged kernel split by KV heads", NgramDrafter(k=4, vocab_size=cfg.vocab_size),
             ServingOptions(packed=True, tree=TreeSpec("topk", 5, 3), attention="interpret"))):
        engine = ServingEngine(cfg, params, drafter, num_slots=3, slot_len=64, page_size=16, forcing=True,
                               options=opts, mesh=tp_mesh(tp))
        assert len(engine.params.layers[0].w_down.sharding.device_set) == tp
        report = check_serving_forcing(engine, prompts, reference, 12, tolerance=TOL)
        assert report.passed, f"serving seed {seed} tp {tp} {label}: {report.summary()}"
        print(f"ok serving seed {seed} tp {tp} {label}: {report.summary()}")
    # our GEMM, norm and attention kernels (interpret mode) under the mesh, as the bench serves:
    # each split matrix a per-device kernel; every served token rounds as the sharded kernel
    # engine's AR step (forcing with no near-tie allowance)
    from specjax.serving.decoder import ServingDecoder
    bcfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8,
                       num_kv_heads=4, head_dim=16, max_position_embeddings=256, dtype="bfloat16")  # shards tile
    bparams = init_random_params(bcfg, jax.random.PRNGKey(seed), scale=0.5)
    gen = GenerationConfig(max_new_tokens=12)
    kref = Decoder(bcfg, bparams, gen, kernels="interpret", mesh=tp_mesh(tp)).generate(prompts)
    for label, opts in (("packed, budget, device loop", ServingOptions(packed=True, budget=6, steps_per_call=4)),
                        ("trees, paged kernel", ServingOptions(packed=True, tree=TreeSpec("topk", 5, 3),
                                                               attention="interpret"))):
        dec = ServingDecoder(bcfg, bparams, gen, NgramDrafter(k=4, vocab_size=cfg.vocab_size), num_slots=3,
                             options=opts, kernels="interpret", mesh=tp_mesh(tp))
        assert type(dec.params.layers[0].w_gate_up).__name__ == "TPGemmWeight"
        report = check_token_forcing(dec, prompts, kref, tolerance=0.0)
        assert report.passed and not report.failures, f"serving kernels tp {tp} {label}: {report.summary()}"
        print(f"ok serving seed {seed} tp {tp} kernels split over the mesh, {label}: {report.summary()}")


def hybrid(seed: int, tp: int):
    rng = np.random.default_rng(seed)
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    rng.shuffle(kinds)
    cfg = HybridConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4, layer_types=tuple(kinds),
        num_heads=4, num_kv_heads=2, head_dim=8, partial_rotary_factor=0.5, rope_theta=10000.0,
        rms_norm_eps=1e-6, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=3, max_position_embeddings=512, dtype="float32")
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(seed), scale=0.3)
    prompts = prompts_for(rng, cfg.vocab_size)
    gen = GenerationConfig(max_new_tokens=16)
    mesh = tp_mesh(tp)
    reference = Decoder(cfg, params, gen).generate(prompts)
    got = Decoder(cfg, params, gen, mesh=mesh).generate(prompts)
    if all(min(m, default=np.inf) >= TOL for m in reference.margins):
        assert got.tokens == reference.tokens, f"hybrid seed {seed} tp {tp}: AR tokens differ"
    print(f"ok hybrid AR seed {seed} tp {tp}")
    dcfg = ModelConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=8, max_position_embeddings=512)
    small = small_model_drafter(init_random_params(dcfg, jax.random.PRNGKey(seed + 1), 0.3), dcfg, cfg, k=3)
    for label, drafter, tree in (("ngram", NgramDrafter(k=4), None), ("small AR drafter", small, None),
                                 ("small AR drafter tree 6", small, TreeSpec.budget("topk", 6, 3))):
        dec = Decoder(cfg, params, gen, drafter=drafter, tree=tree, mesh=mesh)
        check(f"hybrid seed {seed} tp {tp} {label}", dec, prompts, reference)
    hybrid_kernels_split(seed, mesh)
    # the attention and tree-GDN kernels (interpret mode) split by heads: per head the one-device
    # kernel's arithmetic, so the sharded kernel decoder gives the unsharded one's tokens exactly
    ngram = NgramDrafter(k=4, vocab_size=cfg.vocab_size)
    for label, tree in (("chain", None), ("tree 6", TreeSpec.budget("topk", 6, 3))):
        dec = Decoder(cfg, params, gen, drafter=ngram, tree=tree, kernels="interpret", mesh=mesh)
        check(f"hybrid seed {seed} tp {tp} kernels split by heads, {label}", dec, prompts, reference)
        alone = Decoder(cfg, params, gen, drafter=ngram, tree=tree, kernels="interpret").generate(prompts)
        assert dec.generate(prompts).tokens == alone.tokens, f"hybrid kernels tp {tp} {label}: differ from one device"
    from specjax.serving import ServingEngine, ServingOptions
    from specjax.serving.forcing import check_serving_forcing
    # attention over gathered page views (XLA), then the paged kernel split by KV heads
    for attention in ("xla", "interpret"):
        engine = ServingEngine(cfg, params, ngram, num_slots=2, slot_len=64, page_size=8, forcing=True, mesh=mesh,
                               options=ServingOptions(budget=4, packed=True, steps_per_call=4, two_level_k1=1,
                                                      tree=TreeSpec("topk", 5, 3), attention=attention))
        report = check_serving_forcing(engine, prompts, reference, 16, tolerance=TOL)
        assert report.passed, f"hybrid serving tp {tp} attention {attention}: {report.summary()}"
        print(f"ok hybrid serving seed {seed} tp {tp}, trees with every mechanism, attention {attention}: "
              f"{report.summary()}")


def hybrid_kernels_split(seed: int, mesh):
    """The tree-GDN and attention kernels run in shard_map over the mesh, bitwise the one-device
    kernels on random inputs."""
    import jax.numpy as jnp
    from specjax.sharding.tp_hybrid import attention_kernel, tree_gdn_kernel
    from specjax.trees.tree import Tree
    rng = np.random.default_rng(seed)
    B, N, H, d = 2, 6, 4, 8

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)
    parents = jnp.asarray([[-1, 0, 0, 1, 1, 2]] * B, jnp.int32)
    anc = Tree(jnp.zeros((B, N), jnp.int32), parents, 2).ancestors()
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    gdn_args = (normal(B, H, d, d), unit(normal(B, N, H, d)), unit(normal(B, N, H, d)), normal(B, N, H, d),
                -jnp.abs(normal(B, N, H)), jax.nn.sigmoid(normal(B, N, H)), anc)
    S = 16
    mask = jnp.arange(S)[None, None, :] <= (9 + jnp.arange(N))[None, :, None]
    attn_args = (normal(B, N, H, d), normal(B, S, 2, d), normal(B, S, 2, d), jnp.broadcast_to(mask, (B, N, S)),
                 jnp.full((B,), 9 + N, jnp.int32))
    for name, fn, args in (("tree GDN", lambda *a, mesh=None: tree_gdn_kernel(*a, 2, True, mesh), gdn_args),
                           ("attention", lambda *a, mesh=None: attention_kernel(*a, True, mesh), attn_args)):
        split = jax.jit(lambda *a: fn(*a, mesh=mesh))
        assert "shard_map" in str(jax.make_jaxpr(split)(*args)), f"{name}: not split over the mesh"
        np.testing.assert_array_equal(np.asarray(split(*args)), np.asarray(jax.jit(fn)(*args)))
        print(f"ok hybrid {name} kernel split by heads: bitwise the one-device kernel")


def kernels(seed: int, tp: int):
    """A bf16 target on the Pallas GEMMs (interpret mode), each matrix split over the mesh and run
    one kernel per device in shard_map: column-parallel GEMMs bitwise those of one device, the
    engine token-exact against the unsharded kernel engine."""
    from pallas_kernels.skinny_gemm import skinny_gemm
    from specjax.sharding.tp_kernels import TPGemmWeight, tp_gemm
    rng = np.random.default_rng(seed)
    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8,
                      num_kv_heads=4, head_dim=16, max_position_embeddings=256, dtype="bfloat16")
    params = init_random_params(cfg, jax.random.PRNGKey(seed), scale=0.5)
    prompts = prompts_for(rng, cfg.vocab_size)
    gen = GenerationConfig(max_new_tokens=12)
    mesh = tp_mesh(tp)
    one = Decoder(cfg, params, gen, kernels="interpret")
    reference = one.generate(prompts)
    sharded = Decoder(cfg, params, gen, kernels="interpret", mesh=mesh)
    layer = sharded.params.layers[0]
    kinds = {f: type(getattr(layer, f)).__name__ for f in ("w_qkv", "w_o", "w_gate_up", "w_down")}
    assert set(kinds.values()) == {"TPGemmWeight"}, kinds
    assert isinstance(sharded.params.lm_head, TPGemmWeight)
    x = jax.random.normal(jax.random.PRNGKey(seed), (5, cfg.hidden_size), jax.numpy.bfloat16)
    col = layer.w_gate_up
    assert col.mode == "column" and len(col.w.sharding.device_set) == tp
    np.testing.assert_array_equal(np.asarray(tp_gemm(x, col)),
                                  np.asarray(skinny_gemm(x, one.params.layers[0].w_gate_up)))
    print(f"ok kernels seed {seed} tp {tp}: column-parallel GEMM bitwise equal to one device")
    # the attention kernels split by KV heads: bitwise the one-device kernels
    from pallas_kernels.decode_attention import decode_attention
    from pallas_kernels.tree_attention import tree_attention
    from specjax.models.transformer import causal_slot_mask
    from specjax.sharding.tp_attention import bind, head_parallel, splits_heads
    from specjax.trees.tree import Tree
    assert sharded.params.mesh is mesh and splits_heads(mesh, cfg.num_kv_heads)
    r = np.random.default_rng(seed)
    B, T, S = 2, 5, 64
    q = jax.numpy.asarray(r.normal(0, 1, (B, T, cfg.num_heads, cfg.head_dim)), jax.numpy.bfloat16)
    kc, vc = (jax.numpy.asarray(r.normal(0, 1, (B, S, cfg.num_kv_heads, cfg.head_dim)), jax.numpy.bfloat16)
              for _ in range(2))
    start = jax.numpy.array([20, 33], jax.numpy.int32)
    mask = causal_slot_mask(start, T, S)
    one_dev = decode_attention(q, kc, vc, mask, start + T, interpret=True)
    split = head_parallel(bind(decode_attention, interpret=True), mesh, q, kc, vc, mask, start + T)
    np.testing.assert_array_equal(np.asarray(split, np.float32), np.asarray(one_dev, np.float32))
    tree = Tree(tokens=jax.numpy.zeros((B, T), jax.numpy.int32),
                parents=jax.numpy.array([[-1, 0, 0, 1, 2], [-1, 0, 1, 1, 0]], jax.numpy.int32), max_depth=T - 1)
    anc = tree.ancestors()
    args = (start, anc, tree.depths(anc))
    one_dev = tree_attention(q, kc, vc, *args, T - 1, interpret=True)
    split = head_parallel(bind(tree_attention, max_depth=T - 1, interpret=True), mesh, q, kc, vc, *args)
    np.testing.assert_array_equal(np.asarray(split, np.float32), np.asarray(one_dev, np.float32))
    print(f"ok kernels seed {seed} tp {tp}: attention kernels split by KV heads bitwise equal to one device")
    got = sharded.generate(prompts)
    if all(min(m, default=np.inf) >= TOL for m in reference.margins):
        assert got.tokens == reference.tokens, f"kernels seed {seed} tp {tp}: AR tokens differ"
    print(f"ok kernels AR seed {seed} tp {tp}")
    check(f"kernels seed {seed} tp {tp} ngram", Decoder(cfg, params, gen, drafter=NgramDrafter(k=4),
                                                          kernels="interpret", mesh=mesh), prompts, reference)


def kernels_lh12(seed: int, tp: int):
    """12-bit weights on the kernels, split over the mesh: each device packs its own shard under
    the tensor's window base (specjax/sharding/tp_lh12.py). Column-parallel 12-bit GEMMs equal the
    bf16 ones of one device bit for bit; the engine gives the sharded bf16 kernel engine's tokens
    exactly (the same arithmetic on the same weights) and passes token forcing."""
    from pallas_kernels.skinny_gemm import skinny_gemm
    from specjax.sharding.tp_lh12 import tp_gemm_lh12
    rng = np.random.default_rng(seed)
    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8,
                      num_kv_heads=4, head_dim=16, max_position_embeddings=256, dtype="bfloat16")
    params = init_random_params(cfg, jax.random.PRNGKey(seed), scale=0.5)
    # zeros in the first shard's columns only: its escape words outnumber the other shards'
    gu = params.layers[0].w_gate_up
    params.layers[0] = dataclasses.replace(params.layers[0], w_gate_up=gu.at[::7, :gu.shape[1] // (2 * tp)].set(0))
    prompts = prompts_for(rng, cfg.vocab_size)
    gen = GenerationConfig(max_new_tokens=12)
    mesh = tp_mesh(tp)
    lh12 = {"attn": "lh12", "mlp": "lh12", "head": "lh12"}
    one = Decoder(cfg, params, gen, kernels="interpret")
    sharded16 = Decoder(cfg, params, gen, kernels="interpret", mesh=mesh)
    sharded12 = Decoder(cfg, params, gen, kernels="interpret", mesh=mesh, weights_format=lh12)
    layer = sharded12.params.layers[0]
    kinds = {f: type(getattr(layer, f)).__name__ for f in ("w_qkv", "w_o", "w_gate_up", "w_down")}
    assert set(kinds.values()) == {"TPLh12Weight"}, kinds
    assert layer.w_gate_up.code.shape[0] == tp and len(layer.w_gate_up.code.sharding.device_set) == tp
    assert int(layer.w_gate_up.tile_escapes[0].sum()) > int(layer.w_gate_up.tile_escapes[-1].sum())
    x = jax.random.normal(jax.random.PRNGKey(seed), (5, cfg.hidden_size), jax.numpy.bfloat16)
    np.testing.assert_array_equal(np.asarray(tp_gemm_lh12(x, layer.w_gate_up)),
                                  np.asarray(skinny_gemm(x, one.params.layers[0].w_gate_up)))
    print(f"ok kernels_lh12 seed {seed} tp {tp}: column-parallel 12-bit GEMM bitwise equal to one device's bf16")
    reference = sharded16.generate(prompts)
    got = sharded12.generate(prompts)
    assert got.tokens == reference.tokens, f"kernels_lh12 seed {seed} tp {tp}: tokens differ from sharded bf16"
    print(f"ok kernels_lh12 AR seed {seed} tp {tp}: the sharded bf16 engine's tokens")
    check(f"kernels_lh12 seed {seed} tp {tp} ngram",
          Decoder(cfg, params, gen, drafter=NgramDrafter(k=4), kernels="interpret", mesh=mesh, weights_format=lh12),
          prompts, reference)


if __name__ == "__main__":
    assert jax.device_count() >= 4, "run with XLA_FLAGS=--xla_force_host_platform_device_count=4"
    which = sys.argv[1]
    # dense at both splits; the hybrid target at 2 (its 2 key heads split evenly), serving at 4:
    # one case each keeps the CI minutes down (each case is a dozen compiles)
    cases = {"dense": ((11, 4), (12, 2)), "hybrid": ((12, 2),), "serving": ((11, 4),),
             "kernels": ((13, 2),), "kernels_lh12": ((14, 2),)}[which]
    for seed, tp in cases:
        {"dense": dense, "hybrid": hybrid, "serving": serving, "kernels": kernels,
         "kernels_lh12": kernels_lh12}[which](seed, tp)
