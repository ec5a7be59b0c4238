"""The hybrid recurrent target (Qwen3-Next style) against transformers on tiny random models created
locally with save_pretrained (transformers' torch fallback path: no flash-linear-attention or
causal-conv1d here), fp32: prefill and step-by-step decode logits; chunked vs token-by-token
equivalence of `hybrid_forward`; bf16 checkpoints; clear errors for MoE configs and bad checkpoints."""

from __future__ import annotations

import copy
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from specjax.errors import ConfigError, ModelFormatError
from specjax.models.hybrid import (hybrid_forward, hybrid_logits, init_hybrid_cache,
                                   init_random_hybrid_params)
from specjax.models.hybrid_config import HybridConfig, from_hf_dict
from specjax.models.hybrid_loading import load_hybrid

TOL = 1e-4
forward = jax.jit(hybrid_forward, static_argnums=1)

CASES = {
    # default layer pattern (3 linear : 1 full), 2 value heads per key head, untied head
    "interval4_untied": dict(seed=0, config=dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, num_experts=0, initializer_range=0.08)),
    # explicit layer types starting with attention, 3 value heads per key head, half-rotary, conv K=3,
    # tied head; experts configured but every layer listed in mlp_only_layers, so all MLPs are dense
    "custom_types_tied": dict(seed=1, config=dict(
        vocab_size=200, hidden_size=48, intermediate_size=80, num_hidden_layers=5, num_attention_heads=2,
        num_key_value_heads=1, head_dim=24, linear_num_key_heads=1, linear_num_value_heads=3,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=3,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                     "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
        num_experts=4, mlp_only_layers=[0, 1, 2, 3, 4], tie_word_embeddings=True, initializer_range=0.08)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
    """(case name, transformers model, checkpoint directory)."""
    case = CASES[request.param]
    config = transformers.Qwen3NextConfig(**case["config"])
    torch.manual_seed(case["seed"])
    model = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # away from their init so a missing/misplaced (1 + w) shows
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("A_log"):  # slow decays: the state must carry over many tokens
                p.copy_(torch.empty_like(p).uniform_(0.05, 1.0).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "conv1d" in name:
                p.copy_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return request.param, model, path


def test_prefill_and_decode_match_transformers(saved):
    name, model, path = saved
    cfg, params = load_hybrid(path)
    assert cfg.num_layers == model.config.num_hidden_layers
    rng = np.random.default_rng(CASES[name]["seed"])
    B, P, steps = 2, 11, 6
    full = rng.integers(0, cfg.vocab_size, size=(B, P + steps))
    with torch.no_grad():
        want = model(torch.tensor(full)).logits.numpy()
    assert np.abs(want).max() > 1.0  # logits big enough for TOL to mean something

    cache = init_hybrid_cache(cfg, B, 32)
    pos = np.broadcast_to(np.arange(P), (B, P)).astype(np.int32)
    hidden, cache = forward(params, cfg, jnp.asarray(full[:, :P], jnp.int32), jnp.asarray(pos), cache,
                            jnp.zeros(B, jnp.int32))
    assert np.max(np.abs(np.asarray(hybrid_logits(params, hidden)) - want[:, :P])) <= TOL

    for p in range(P, P + steps):  # one token at a time from the cache
        hidden, cache = forward(params, cfg, jnp.asarray(full[:, p:p + 1], jnp.int32),
                                jnp.full((B, 1), p, jnp.int32), cache, jnp.full(B, p, jnp.int32))
        got = np.asarray(hybrid_logits(params, hidden[:, 0]))
        assert np.max(np.abs(got - want[:, p])) <= TOL, f"decode position {p}"


def test_bf16_checkpoint(saved, tmp_path):
    """A bf16 checkpoint loads to exactly the bf16 rounding of the fp32 weights (the fused layouts
    only move columns), and a bf16 forward strays from the fp32 logits about as far as transformers'
    own bf16 forward does (a sanity bound, not parity: the two round at different places)."""
    _, model, src = saved
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    model16.save_pretrained(tmp_path, safe_serialization=True)
    cfg, params = load_hybrid(tmp_path, dtype="bfloat16")
    cfg32, p32 = load_hybrid(src)
    assert cfg == cfg32.with_dtype("bfloat16")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p32)):
        assert a.dtype == jnp.bfloat16 and np.array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))

    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(1, 9))
    with torch.no_grad():
        want = model(torch.tensor(tokens)).logits.numpy()
        torch_err = np.abs(model16(torch.tensor(tokens)).logits.float().numpy() - want).mean()
    hidden, cache = forward(params, cfg, jnp.asarray(tokens, jnp.int32), jnp.arange(9, dtype=jnp.int32)[None],
                            init_hybrid_cache(cfg, 1, 16), jnp.zeros(1, jnp.int32))
    assert cache.state[0].dtype == jnp.float32  # the recurrent state stays float32 in bf16
    assert np.abs(np.asarray(hybrid_logits(params, hidden)) - want).mean() <= 2 * torch_err


RANDOM_CONFIGS = [
    (11, HybridConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                      layer_types=("linear_attention", "full_attention", "linear_attention",
                                   "linear_attention"),
                      num_heads=4, num_kv_heads=2, head_dim=8, partial_rotary_factor=0.5,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_conv_kernel_dim=4)),
    (12, HybridConfig(vocab_size=50, hidden_size=24, intermediate_size=40, num_layers=3,
                      layer_types=("full_attention", "linear_attention", "full_attention"),
                      num_heads=2, num_kv_heads=2, head_dim=12, partial_rotary_factor=1.0,
                      linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=6,
                      linear_value_head_dim=10, linear_conv_kernel_dim=2, tie_word_embeddings=True)),
]


@pytest.mark.parametrize("seed,cfg", RANDOM_CONFIGS)
def test_chunk_equals_single_steps(seed, cfg):
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(seed), scale=0.1)
    rng = np.random.default_rng(seed)
    B, P, C = 2, 7, 5
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(B, P + C)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(P + C, dtype=jnp.int32), (B, P + C))
    _, prefix = forward(params, cfg, tokens[:, :P], positions[:, :P], init_hybrid_cache(cfg, B, 16),
                        jnp.zeros(B, jnp.int32))

    chunk_hidden, chunk_cache = forward(params, cfg, tokens[:, P:], positions[:, P:], prefix,
                                        jnp.full(B, P, jnp.int32))
    cache, hiddens = prefix, []
    for p in range(P, P + C):
        h, cache = forward(params, cfg, tokens[:, p:p + 1], positions[:, p:p + 1], cache,
                           jnp.full(B, p, jnp.int32))
        hiddens.append(h)
    step_logits = hybrid_logits(params, jnp.concatenate(hiddens, axis=1))
    np.testing.assert_allclose(hybrid_logits(params, chunk_hidden), step_logits, rtol=0, atol=1e-5)
    for field in ("state", "conv", "k", "v"):
        for a, b in zip(getattr(chunk_cache, field), getattr(cache, field)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=field)
    assert float(jnp.max(jnp.abs(chunk_cache.state[0]))) > 0.01  # the state is live, not decayed away


def test_moe_config_is_refused():
    d = transformers.Qwen3NextConfig(**{**CASES["interval4_untied"]["config"], "num_experts": 8,
                                        "decoder_sparse_step": 2}).to_dict()
    with pytest.raises(ModelFormatError, match=r"ckpt/config.json: layers \[1, 3\] are mixture-of-experts "
                                               r"\(num_experts=8.*MoE layers are not implemented"):
        from_hf_dict(d, where="ckpt/config.json")
    d.pop("num_experts")  # absent means transformers' default: 512 experts
    with pytest.raises(ModelFormatError, match="num_experts=512"):
        from_hf_dict(d)


@pytest.mark.parametrize("change,match", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope_type 'yarn'"),
    (dict(model_type="llama", architectures=["LlamaForCausalLM"]), "unsupported architecture"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
])
def test_unsupported_config_fields_are_named(change, match):
    d = {**transformers.Qwen3NextConfig(**CASES["interval4_untied"]["config"]).to_dict(), **change}
    with pytest.raises(ModelFormatError, match=match):
        from_hf_dict(d)


def test_legacy_config_keys_read_as_transformers_reads_them():
    """Older config.json files: top-level rope_theta / partial_rotary_factor, full_attention_interval
    instead of layer_types."""
    d = dict(model_type="qwen3_next", vocab_size=100, hidden_size=32, intermediate_size=64,
             num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             rope_theta=5e5, partial_rotary_factor=0.5, rope_scaling=None, full_attention_interval=3,
             num_experts=0, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
             linear_value_head_dim=8)
    ref = transformers.Qwen3NextConfig.from_dict(d)
    cfg = from_hf_dict(d)
    assert cfg.layer_types == tuple(ref.layer_types)
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"]
    assert cfg.partial_rotary_factor == ref.rope_parameters["partial_rotary_factor"]


def test_config_validation_names_the_field():
    seed_cfg = RANDOM_CONFIGS[0][1]
    with pytest.raises(ConfigError, match="layer_types has 3 entries, num_layers is 4"):
        dataclasses.replace(seed_cfg, layer_types=seed_cfg.layer_types[:3])
    with pytest.raises(ConfigError, match="unknown kinds"):
        dataclasses.replace(seed_cfg, layer_types=("moe",) * 4)


def _copy_with(src, dst, edit):
    """The checkpoint at src, its tensors changed by `edit(dict)`, written to dst."""
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")


def test_bad_checkpoints_name_the_tensor(saved, tmp_path):
    _, _, src = saved
    gdn_layer = json.loads((src / "config.json").read_text())["layer_types"].index("linear_attention")
    missing = f"model.layers.{gdn_layer}.linear_attn.A_log"
    _copy_with(src, tmp_path, lambda t: t.pop(missing))
    with pytest.raises(ModelFormatError, match=f"tensor '{missing}' is missing"):
        load_hybrid(tmp_path)

    wrong = f"model.layers.{gdn_layer}.linear_attn.in_proj_ba.weight"
    _copy_with(src, tmp_path, lambda t: t.update({wrong: np.zeros((3, 5), np.float32)}))
    with pytest.raises(ModelFormatError, match=f"tensor {wrong} has shape \\(3, 5\\), expected"):
        load_hybrid(tmp_path)


def test_engine_generates_transformers_greedy_tokens(saved):
    """The checkpoint through `load_model` (the CLI's loader) and the engine: plain AR, chain and
    tree speculative decoding all give transformers' own greedy continuation."""
    from specjax.decoding.sequences import GenerationConfig
    from specjax.drafters.ngram import NgramDrafter
    from specjax.engine import Decoder
    from specjax.models.hybrid_config import HybridConfig
    from specjax.models.loading import load_model
    from specjax.trees.builders import TreeSpec
    name, model, path = saved
    loaded = load_model(str(path))
    assert isinstance(loaded.cfg, HybridConfig)
    prompt = np.random.default_rng(CASES[name]["seed"] + 1).integers(0, loaded.cfg.vocab_size, 9).tolist()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              pad_token_id=0).numpy()[0, len(prompt):].tolist()
    gen = GenerationConfig(max_new_tokens=12)
    drafter = NgramDrafter(k=3, vocab_size=loaded.cfg.vocab_size)
    for kwargs in ({}, dict(drafter=drafter), dict(drafter=drafter, tree=TreeSpec.budget("topk", 5, 3))):
        got = Decoder(loaded.cfg, loaded.params, gen, **kwargs).generate([prompt]).tokens[0]
        assert got == want, kwargs
