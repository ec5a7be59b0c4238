"""Speculative decoding of hybrid recurrent targets (Gated DeltaNet + attention) is lossless:
token forcing against plain AR decoding of the same target with zero failures, free-running
equality, and right-padded prompt batches that leave each row's recurrent state untouched by
padding. Random tiny configs (fresh seeds), float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding.sequences import GenerationConfig, prefill
from specjax.drafters.model_drafter import small_model_drafter
from specjax.drafters.ngram import NgramDrafter
from specjax.engine import Decoder
from specjax.forcing import check_token_forcing
from specjax.models.config import ModelConfig
from specjax.models.hybrid import init_random_hybrid_params
from specjax.models.hybrid_config import HybridConfig
from specjax.models.params import init_random_params

TOL = 1e-3


def hybrid_config(seed: int) -> HybridConfig:
    rng = np.random.default_rng(seed)
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    rng.shuffle(kinds)
    hk = int(rng.integers(1, 3))
    return HybridConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4, layer_types=tuple(kinds),
        num_heads=4, num_kv_heads=2, head_dim=8, partial_rotary_factor=0.5, rope_theta=10000.0,
        rms_norm_eps=1e-6, linear_num_key_heads=hk, linear_num_value_heads=hk * int(rng.integers(1, 3)),
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=int(rng.integers(2, 5)),
        tie_word_embeddings=bool(rng.integers(0, 2)), max_position_embeddings=512, dtype="float32")


def repetitive_prompts(rng, count: int, vocab: int) -> list[list[int]]:
    """Prompts with repeats, so the n-gram drafter has matches to propose."""
    prompts = []
    for _ in range(count):
        motif = rng.integers(3, vocab, int(rng.integers(3, 7))).tolist()
        prompts.append((motif * 4)[: int(rng.integers(8, 20))])
    return prompts


def assert_exact(decoder, prompts, reference):
    report = check_token_forcing(decoder, prompts, reference, tolerance=TOL)
    assert report.passed, report.summary() + "\n" + "\n".join(map(str, report.failures[:10]))
    free = decoder.generate(prompts)
    if all(min(m, default=np.inf) >= TOL for m in reference.margins):
        assert free.tokens == reference.tokens


@pytest.mark.parametrize("seed", [101, 202])
def test_chain_decoding_of_hybrid_targets_is_exact(seed):
    cfg = hybrid_config(seed)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(seed), scale=0.3)
    rng = np.random.default_rng(seed)
    prompts = repetitive_prompts(rng, 3, cfg.vocab_size)
    gen = GenerationConfig(max_new_tokens=24)
    reference = Decoder(cfg, params, gen).generate(prompts)
    dcfg = ModelConfig(vocab_size=cfg.vocab_size, hidden_size=16, intermediate_size=32, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=512)
    small = small_model_drafter(init_random_params(dcfg, jax.random.PRNGKey(seed + 1), 0.3), dcfg, cfg, k=3)
    for drafter in (NgramDrafter(k=4), small):
        assert_exact(Decoder(cfg, params, gen, drafter=drafter), prompts, reference)


def test_padding_never_reaches_the_recurrent_state():
    """A prompt prefilled alone and the same prompt right-padded in a batch with a longer one give
    the same state, window and first token."""
    cfg = hybrid_config(7)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(7), scale=0.3)
    gen = GenerationConfig(max_new_tokens=4)
    short, long = [5, 9, 11, 4, 20], list(range(3, 17))
    batch = jnp.zeros((2, 16), jnp.int32).at[0, :5].set(jnp.array(short)).at[1, :14].set(jnp.array(long))
    cache_b, seqs_b, _, _ = prefill(params, cfg, gen, batch, jnp.array([5, 14]), 64, jax.random.PRNGKey(0))
    alone = jnp.zeros((1, 16), jnp.int32).at[0, :5].set(jnp.array(short))
    cache_a, seqs_a, _, _ = prefill(params, cfg, gen, alone, jnp.array([5]), 64, jax.random.PRNGKey(0))
    for sb, sa in zip(cache_b.state + cache_b.conv, cache_a.state + cache_a.conv):
        np.testing.assert_allclose(sb[:1], sa, atol=1e-6)
        assert float(jnp.abs(sa).max()) > 0
    assert int(seqs_b.pending()[0]) == int(seqs_a.pending()[0])


def test_replayed_path_is_plain_decoding_bit_for_bit():
    """The replay of a deferred path gives each GDN layer the state and window that plain decoding
    (one `gdn_advance` call per token) computes from the same projections, bit for bit; rows stop
    at their own path length."""
    from specjax.models.gated_deltanet import gdn_advance, gdn_project
    from specjax.models.hybrid_tree import gdn_replay
    cfg = hybrid_config(11)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(11), scale=0.3)
    rng = np.random.default_rng(11)
    B, R = 2, 5
    counts = jnp.array([3, 5], jnp.int32)  # row 0 accepted 2 drafts, row 1 all 4
    replay = jax.jit(gdn_replay, static_argnums=1)
    decode = jax.jit(gdn_advance, static_argnums=1)
    for layer in cfg.gdn_layers:
        p = params.layers[layer].gdn
        s0 = jnp.asarray(rng.normal(size=(B, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                          cfg.linear_value_head_dim)), jnp.float32)
        w0 = jnp.asarray(rng.normal(size=(B, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)), jnp.float32)
        h = jnp.asarray(rng.normal(size=(B, R, cfg.hidden_size)), jnp.float32)
        _, state, window = replay(p, cfg, h, s0, w0, counts)
        conv_in, _, b, a = gdn_project(p, cfg, h)
        s, w = s0, w0
        for d in range(R):  # one token per call, a row past its path masked out
            _, s, w = decode(p, cfg, s, w, conv_in[:, d:d + 1], b[:, d:d + 1], a[:, d:d + 1],
                             (d < counts).astype(jnp.int32))
        np.testing.assert_array_equal(np.asarray(state), np.asarray(s))
        np.testing.assert_array_equal(np.asarray(window), np.asarray(w))


def test_verify_defers_the_path_and_settling_equals_plain_decoding():
    """A verify step leaves every GDN state as it was and the commit stores only the accepted
    path's tokens (R ints a row: no per-node record); settling the cache replays them, giving the
    states plain decoding reaches over the same tokens."""
    from specjax.models.target import (chain_verify, target_commit, target_forward, target_settle,
                                       with_replay_width)
    cfg = hybrid_config(12)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(12), scale=0.3)
    gen = GenerationConfig(max_new_tokens=4)
    prompt = jnp.array([[5, 9, 11, 4, 20, 7]], jnp.int32)
    cache, seqs, _, _ = prefill(params, cfg, gen, prompt, jnp.array([6]), 32, jax.random.PRNGKey(0))
    pos = seqs.length - 1
    tokens = jnp.concatenate([seqs.pending()[:, None], jnp.array([[13, 2, 40]], jnp.int32)], axis=1)
    positions = pos[:, None] + jnp.arange(4)[None, :]
    prepared = with_replay_width(params, cfg, cache, 4)
    _, _, verified, pending = chain_verify(params, cfg, tokens, positions, prepared, pos, ())
    for a, b in zip(verified.state + verified.conv, cache.state + cache.conv):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    path = jnp.arange(4, dtype=jnp.int32)[None]
    committed = target_commit(params, cfg, verified, pending, path, jnp.array([2]), pos, is_chain=True)
    assert committed.replay.shape == (1, 4) and int(committed.replay_len[0]) == 3
    settled = target_settle(params, cfg, committed)
    plain = cache
    for d in range(3):  # the root and two drafts, one AR step each
        _, _, plain = target_forward(params, cfg, tokens[:, d:d + 1], positions[:, d:d + 1], plain, pos + d)
    for a, b in zip(settled.state + settled.conv, plain.state + plain.conv):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert int(settled.replay_len[0]) == 0


@pytest.mark.parametrize("builder,nodes", [("topk", 6), ("static", 1), ("best_first", 12)])
def test_tree_decoding_of_hybrid_targets_is_exact(builder, nodes):
    """Trees on a hybrid target: GDN layers verify every node from the committed state (the
    tree-parallel form) and replay the accepted path; token forcing finds no failure."""
    from specjax.trees.builders import TreeSpec
    seed = 300 + nodes
    cfg = hybrid_config(seed)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(seed), scale=0.3)
    prompts = repetitive_prompts(np.random.default_rng(seed), 3, cfg.vocab_size)
    gen = GenerationConfig(max_new_tokens=20)
    reference = Decoder(cfg, params, gen).generate(prompts)
    drafter = NgramDrafter(k=4, vocab_size=cfg.vocab_size)
    tree = TreeSpec.budget(builder, nodes, 4)
    assert_exact(Decoder(cfg, params, gen, drafter=drafter, tree=tree), prompts, reference)


def test_block_drafter_and_kernels_on_a_hybrid_target():
    """A (random) block drafter conditioned on the hybrid target's layers, chain and best-first
    tree; and the tree verify step with the Pallas kernels in interpret mode (fused attention,
    tree GDN): token forcing finds no failure."""
    from specjax.drafters.block import init_block_drafter
    from specjax.trees.builders import TreeSpec
    cfg = hybrid_config(404)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(404), scale=0.3)
    prompts = repetitive_prompts(np.random.default_rng(404), 2, cfg.vocab_size)
    gen = GenerationConfig(max_new_tokens=12)
    reference = Decoder(cfg, params, gen).generate(prompts)
    block = init_block_drafter(params, cfg, jax.random.PRNGKey(5), block_size=4, num_layers=1)
    assert_exact(Decoder(cfg, params, gen, drafter=block), prompts, reference)
    assert_exact(Decoder(cfg, params, gen, drafter=block, tree=TreeSpec.budget("best_first", 6, 3)),
                 prompts, reference)
    ngram = NgramDrafter(k=3, vocab_size=cfg.vocab_size)
    assert_exact(Decoder(cfg, params, gen, drafter=ngram, tree=TreeSpec.budget("topk", 5, 3),
                         kernels="interpret"), prompts, reference)


def test_layer_skip_refuses_hybrid_targets():
    from specjax.drafters.model_drafter import layer_skip_drafter
    cfg = hybrid_config(5)
    with pytest.raises(NotImplementedError, match="dense target"):
        layer_skip_drafter(init_random_hybrid_params(cfg, jax.random.PRNGKey(0)), cfg, 2, 3)
