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


def test_committed_state_is_plain_decoding_bit_for_bit():
    """After a verify step, each GDN layer's state and window equal, bit for bit, what plain
    decoding (one `gdn_advance` call per token) computes from the same projections; rows stop at
    their own path length."""
    from specjax.models.gated_deltanet import gdn_advance
    from specjax.models.hybrid import init_hybrid_cache
    from specjax.models.hybrid_tree import PendingGDN, commit_states
    cfg = hybrid_config(11)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(11), scale=0.3)
    rng = np.random.default_rng(11)
    B, N, Hv = 2, 8, cfg.linear_num_value_heads
    cache = init_hybrid_cache(cfg, B, 16)
    cache.state = [jnp.asarray(rng.normal(size=s.shape), jnp.float32) for s in cache.state]
    cache.conv = [jnp.asarray(rng.normal(size=c.shape), jnp.float32) for c in cache.conv]
    pending = [PendingGDN(jnp.asarray(rng.normal(size=(B, N, cfg.conv_dim)), jnp.float32),
                          jnp.asarray(rng.normal(size=(B, N, Hv)), jnp.float32),
                          jnp.asarray(rng.normal(size=(B, N, Hv)), jnp.float32)) for _ in cfg.gdn_layers]
    path = jnp.array([[0, 2, 4, 4, 4], [0, 1, 3, 6, 7]], jnp.int32)  # row 0 accepts 2 drafts, row 1 all 4
    num_accepted = jnp.array([2, 4], jnp.int32)
    states, windows = jax.jit(commit_states, static_argnums=1)(params, cfg, cache, pending, path, num_accepted)
    decode = jax.jit(gdn_advance, static_argnums=1)
    counts = jnp.array([3, 5], jnp.int32)
    for n, layer in enumerate(cfg.gdn_layers):
        p, r = params.layers[layer].gdn, pending[n]
        s, w = cache.state[n], cache.conv[n]
        for d in range(path.shape[1]):  # one token per call, a row past its path masked out
            node = path[:, d:d + 1, None]
            step = [jnp.take_along_axis(x, node, axis=1) for x in (r.conv_in, r.b, r.a)]
            _, s, w = decode(p, cfg, s, w, *step, (d < counts).astype(jnp.int32))
        np.testing.assert_array_equal(np.asarray(states[n]), np.asarray(s))
        np.testing.assert_array_equal(np.asarray(windows[n]), np.asarray(w))


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
