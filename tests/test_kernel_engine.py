"""The engine on the skinny GEMM kernels (Pallas interpret mode on the CPU): speculative decoding
reproduces AR token for token with no near-tie allowance (every row's matmul is independent of the
step's width), and a 12-bit target yields exactly the bf16 target's tokens."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from conftest import humaneval_prompts
from specjax.decoding.sequences import GenerationConfig
from specjax.drafters.model_drafter import layer_skip_drafter, small_model_drafter
from specjax.drafters.ngram import NgramDrafter
from specjax.engine import Decoder
from specjax.errors import ConfigError
from specjax.forcing import check_token_forcing
from specjax.models.config import ModelConfig
from specjax.models.kernel_params import prepare_kernel_params
from specjax.models.params import init_random_params, truncate_layers

LH12 = {"attn": "lh12", "mlp": "lh12", "head": "lh12"}


def random_bf16_case(seed: int):
    rng = np.random.default_rng(seed)
    kv = int(rng.choice([1, 2]))
    cfg = ModelConfig(vocab_size=int(rng.integers(40, 300)), hidden_size=int(rng.choice([32, 48, 64])),
                      intermediate_size=int(rng.choice([40, 96])), num_layers=int(rng.integers(1, 3)),
                      num_heads=2 * kv, num_kv_heads=kv, head_dim=int(rng.choice([8, 16])),
                      tie_word_embeddings=bool(rng.integers(2)), qk_norm=bool(rng.integers(2)),
                      max_position_embeddings=256, dtype="bfloat16")
    params = init_random_params(cfg, jax.random.PRNGKey(seed), scale=0.3)
    alphabet = int(rng.integers(3, 12))  # small alphabets repeat, so n-grams match
    prompts = [rng.integers(0, alphabet, int(rng.integers(2, 30))).tolist() for _ in range(int(rng.integers(1, 3)))]
    return cfg, params, prompts


@pytest.mark.parametrize("seed,drafter", [(0, "ngram"), (1, "layerskip"), (2, "small"), (3, "ngram")])
def test_chain_on_kernels_equals_ar_exactly(seed, drafter):
    cfg, params, prompts = random_bf16_case(seed)
    gen = GenerationConfig(max_new_tokens=20)
    k = 2 + seed
    if drafter == "ngram":
        d = NgramDrafter(k=k)
    elif drafter == "layerskip":
        d = layer_skip_drafter(params, cfg, 1, k)
    else:
        small_cfg = dataclasses.replace(cfg, num_layers=1, hidden_size=16, intermediate_size=32)
        d = small_model_drafter(init_random_params(small_cfg, jax.random.PRNGKey(9), 0.3), small_cfg, cfg, k)
    fmt = LH12 if seed % 2 else None
    reference = Decoder(cfg, params, gen, kernels="interpret", weights_format=fmt).generate(prompts)
    spec = Decoder(cfg, params, gen, d, kernels="interpret", weights_format=fmt)
    report = check_token_forcing(spec, prompts, reference, tolerance=0.0)
    assert report.passed and not report.failures, report.summary()
    assert spec.generate(prompts).tokens == reference.tokens


def test_lh12_target_equals_bf16_target_on_kernels():
    cfg, params, prompts = random_bf16_case(7)
    gen = GenerationConfig(max_new_tokens=24)
    a = Decoder(cfg, params, gen, kernels="interpret").generate(prompts)
    b = Decoder(cfg, params, gen, kernels="interpret", weights_format=LH12).generate(prompts)
    assert a.tokens == b.tokens
    assert np.array_equal(np.asarray(a.margins, dtype=object), np.asarray(b.margins, dtype=object))


def test_kernel_params_report_and_errors():
    cfg, params, _ = random_bf16_case(8)
    bits = jax.lax.bitcast_convert_type(params.layers[0].w_down, jax.numpy.uint16)
    heavy = bits.at[::3, :].set(0)  # zeros (exponent 0) in a third of the rows: escapes everywhere
    params.layers[0].w_down = jax.lax.bitcast_convert_type(heavy, jax.numpy.bfloat16)
    prepared, report = prepare_kernel_params(params, cfg, LH12, interpret=True)
    by_name = {r.name: r for r in report}
    assert by_name["layers.0.w_down"].format == "bf16" and "kept bf16" in by_name["layers.0.w_down"].reason
    assert by_name["layers.0.w_qkv"].format == "lh12" and by_name["layers.0.w_qkv"].bits_per_weight < 13
    assert by_name["lm_head"].shape == (cfg.hidden_size, cfg.vocab_size)
    assert len(report) == 4 * cfg.num_layers + 1
    with pytest.raises(ConfigError, match="bf16 weights"):
        prepare_kernel_params(params, dataclasses.replace(cfg, dtype="float32"))
    with pytest.raises(ConfigError, match="weight format"):
        prepare_kernel_params(params, cfg, {"attn": "int4"})
    with pytest.raises(ConfigError, match="kernels"):
        Decoder(cfg, params, GenerationConfig(max_new_tokens=2), kernels="cuda")
    if jax.devices()[0].platform != "gpu":
        with pytest.raises(ConfigError, match="needs a GPU"):
            Decoder(cfg, params, GenerationConfig(max_new_tokens=2), kernels="pallas")
        assert Decoder(cfg, params, GenerationConfig(max_new_tokens=2)).kernels == "xla"


@pytest.mark.slow
def test_smollm2_lh12_equals_bf16_through_the_kernels(smollm2_bf16):
    """Real weights with real escapes, through the 12-bit kernel's escape path: the same greedy
    tokens as the bf16 kernel, and (away from near ties) as plain XLA."""
    model = smollm2_bf16
    # The first 8 of 30 layers (their real weights and escapes; the head too): interpret mode
    # compiles every kernel call apart, and all 30 layers cost ~4 CI minutes for the same check.
    cfg = dataclasses.replace(model.cfg, num_layers=8)
    params = truncate_layers(model.params, 8)
    prompts = [model.tokenizer.encode(humaneval_prompts()[0])[:24]]
    gen = GenerationConfig(max_new_tokens=3)  # interpret mode runs every kernel body in Python
    a = Decoder(cfg, params, gen, kernels="interpret").generate(prompts)
    dec = Decoder(cfg, params, gen, kernels="interpret", weights_format=LH12)
    assert sum(r.format == "lh12" for r in dec.kernel_report) == 4 * cfg.num_layers
    b = dec.generate(prompts)
    assert a.tokens == b.tokens
    x = Decoder(cfg, params, gen, kernels="xla").generate(prompts)
    first_tie = next((i for i, m in enumerate(x.margins[0]) if m < 0.25), len(x.tokens[0]))
    assert a.tokens[0][:first_tie] == x.tokens[0][:first_tie]


def test_bf16_speculation_on_xla_warns_that_it_is_not_promised_exact():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=128, dtype="bfloat16")
    params = init_random_params(cfg, jax.random.PRNGKey(0))
    gen = GenerationConfig(max_new_tokens=2)
    with pytest.warns(UserWarning, match="not promised token-identical"):
        Decoder(cfg, params, gen, NgramDrafter(k=2), kernels="xla")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Decoder(cfg, params, gen, kernels="xla")  # plain AR: nothing to compare
        Decoder(cfg, params, gen, NgramDrafter(k=2), kernels="interpret")  # the kernel path
        f32 = dataclasses.replace(cfg, dtype="float32")
        Decoder(f32, init_random_params(f32, jax.random.PRNGKey(0)), gen, NgramDrafter(k=2), kernels="xla")


@pytest.mark.parametrize("seed,drafter,nodes", [(4, "ngram", 8), (5, "block", 12)])
def test_trees_on_kernels_equal_ar_exactly(seed, drafter, nodes):
    """Tree verification on the kernels reproduces AR token for token with no near-tie allowance:
    each node attends over its path gathered into AR's slot layout (tree_attention.py); under the
    dense tree mask the reductions pair terms by node slot and round differently."""
    from specjax.drafters.block import init_block_drafter
    from specjax.trees.builders import TreeSpec
    cfg, params, prompts = random_bf16_case(seed)
    gen = GenerationConfig(max_new_tokens=24)
    if drafter == "ngram":
        d, spec = NgramDrafter(k=4, vocab_size=cfg.vocab_size), TreeSpec("topk", nodes, 4)
    else:
        d, spec = init_block_drafter(params, cfg, jax.random.PRNGKey(seed), 6, 1), TreeSpec("best_first", nodes, 5)
    reference = Decoder(cfg, params, gen, kernels="interpret").generate(prompts)
    tree = Decoder(cfg, params, gen, d, kernels="interpret", tree=spec)
    report = check_token_forcing(tree, prompts, reference, tolerance=0.0)
    assert report.passed and not report.failures, report.summary()
    assert tree.generate(prompts).tokens == reference.tokens


@pytest.mark.parametrize("seed", [11, 12])
def test_tree_verify_logits_equal_ar_step_logits_bitwise(seed):
    """One tree verify forward on the kernels: every node's logits equal, bit for bit, those of the
    AR steps that decode its path from the same prefix, with the tree straddling the attention
    kernel's 256-slot split boundary (deep nodes sit in another split than AR's path). A wrong
    path gather shows here; the rounding that the dense tree mask gets wrong is rarely visible in
    so small a model on a CPU (in-order dots), so tests/test_tree_attention.py checks that part."""
    from specjax.models.width_check import tree_vs_ar
    cfg, params, _ = random_bf16_case(seed)
    kp, _ = prepare_kernel_params(params, cfg, interpret=True)
    res = tree_vs_ar(kp, cfg, nodes=9, prompt_len=250, batch=2, seed=seed)
    assert max(max(d) for d in res["depths"]) >= 3
    assert all(res["logits_equal"]["tree_mask"]), res
