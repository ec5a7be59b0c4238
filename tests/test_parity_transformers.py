"""specjax's decoder against transformers (the reference implementation) on tiny random models
created locally with save_pretrained: prefill logits and step-by-step decode logits, fp32."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from specjax.models.kv_cache import init_cache
from specjax.models.loading import load_model
from specjax.models.transformer import forward, lm_logits

TOL = 1e-4


def _save(tmp_path, model_cls, config, shard=None):
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms away from 1 so a missing/misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    kwargs = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    return model


CASES = {
    "llama_untied_gqa_llama3rope": lambda: (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), None),
    "llama_tied_bias_sharded": lambda: (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=80, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True, attention_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}), "40KB"),
    "qwen3_qknorm": lambda: (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        vocab_size=91, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3_tied": lambda: (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    spec = CASES[case]()
    model_cls, config = spec[0], spec[1]
    shard = spec[2] if len(spec) > 2 else None
    ref = _save(tmp_path, model_cls, config, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    m = load_model(str(tmp_path))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, size=(2, 11))
    cont = rng.integers(0, config.vocab_size, size=(2, 6))
    full = np.concatenate([prompt, cont], axis=1)
    with torch.no_grad():
        want = ref(torch.tensor(full)).logits.numpy()

    cache = init_cache(m.cfg, 2, 32)
    P = prompt.shape[1]
    pos = np.broadcast_to(np.arange(P), (2, P)).astype(np.int32)
    hidden, cache = forward(m.params, m.cfg, jnp.asarray(prompt, jnp.int32), jnp.asarray(pos), cache,
                            jnp.zeros(2, jnp.int32))
    got = np.asarray(lm_logits(m.params, hidden))
    assert np.max(np.abs(got - want[:, :P])) <= TOL

    for t in range(cont.shape[1]):  # step-by-step decode against the cache
        p = P + t
        hidden, cache = forward(m.params, m.cfg, jnp.asarray(cont[:, t:t + 1], jnp.int32),
                                jnp.full((2, 1), p, jnp.int32), cache, jnp.full(2, p, jnp.int32))
        got = np.asarray(lm_logits(m.params, hidden[:, 0]))
        assert np.max(np.abs(got - want[:, p])) <= TOL, f"decode step {t}"
