"""Checkpoint-directory loading errors name the file and the field."""

from __future__ import annotations

import json

import pytest

from conftest import save_tiny_checkpoint
from specjax.errors import ConfigError, ModelFormatError
from specjax.models.config import from_hf_dict
from specjax.models.loading import load_model


def test_missing_config_field():
    with pytest.raises(ModelFormatError, match=r"cfg\.json: missing field 'hidden_size'"):
        from_hf_dict({"model_type": "llama", "num_attention_heads": 2}, where="cfg.json")


def test_unsupported_rope_scaling():
    d = {"model_type": "llama", "num_attention_heads": 2, "hidden_size": 8, "vocab_size": 5,
         "intermediate_size": 8, "num_hidden_layers": 1, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    with pytest.raises(ModelFormatError, match="yarn"):
        from_hf_dict(d)


def test_inconsistent_heads():
    d = {"model_type": "llama", "num_attention_heads": 3, "num_key_value_heads": 2, "hidden_size": 12,
         "vocab_size": 5, "intermediate_size": 8, "num_hidden_layers": 1}
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        from_hf_dict(d)


def test_missing_shard_and_wrong_shape(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "m")
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelFormatError, match="model-00002-of-00002.safetensors.*missing"):
        load_model(str(path))
    (path / "model.safetensors.index.json").unlink()
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 65
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match=r"mlp.gate_proj.weight has shape \(32, 64\), expected \(32, 65\)"):
        load_model(str(path))


def test_corrupt_safetensors(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelFormatError, match="model.safetensors"):
        load_model(str(path))
