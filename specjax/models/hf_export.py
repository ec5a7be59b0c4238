"""Export a dense model to a transformers checkpoint directory (config.json + model.safetensors):
the same weight values for a PyTorch peer. transformers' own GGUF loader keeps quantized weights
and computes through them; the peer must run the dense weights we run. The inverse of
`loading.assemble_params` (HF names, torch [out, in] layout); written atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.params import ModelParams


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The transformers config of `cfg` (what `config.from_hf_dict` reads back)."""
    if cfg.rope_scaling is not None:
        rope = {"rope_type": cfg.rope_scaling.kind, "factor": cfg.rope_scaling.factor,
                "rope_theta": cfg.rope_theta}
        if cfg.rope_scaling.kind == "llama3":
            rope.update(low_freq_factor=cfg.rope_scaling.low_freq_factor,
                        high_freq_factor=cfg.rope_scaling.high_freq_factor,
                        original_max_position_embeddings=cfg.rope_scaling.original_max_position_embeddings)
    else:
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    qwen3 = cfg.qk_norm
    return {"architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
            "model_type": "qwen3" if qwen3 else "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_parameters": rope,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
            "mlp_bias": False, "torch_dtype": cfg.dtype}


def hf_tensors(cfg: ModelConfig, params: ModelParams) -> dict[str, np.ndarray]:
    """HF name -> float32 array in torch layout."""
    def f32(x):
        return np.asarray(x, np.float32)
    q, kv, F = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out = {"model.embed_tokens.weight": f32(params.embed), "model.norm.weight": f32(params.final_norm)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = f32(params.lm_head).T
    for i, layer in enumerate(params.layers):
        pre = f"model.layers.{i}."
        qkv = f32(layer.w_qkv)
        out[pre + "self_attn.q_proj.weight"] = qkv[:, :q].T
        out[pre + "self_attn.k_proj.weight"] = qkv[:, q:q + kv].T
        out[pre + "self_attn.v_proj.weight"] = qkv[:, q + kv:].T
        out[pre + "self_attn.o_proj.weight"] = f32(layer.w_o).T
        gate_up = f32(layer.w_gate_up)
        out[pre + "mlp.gate_proj.weight"] = gate_up[:, :F].T
        out[pre + "mlp.up_proj.weight"] = gate_up[:, F:].T
        out[pre + "mlp.down_proj.weight"] = f32(layer.w_down).T
        out[pre + "input_layernorm.weight"] = f32(layer.attn_norm)
        out[pre + "post_attention_layernorm.weight"] = f32(layer.mlp_norm)
        if cfg.attention_bias:
            b = f32(layer.b_qkv)
            out[pre + "self_attn.q_proj.bias"], out[pre + "self_attn.k_proj.bias"] = b[:q], b[q:q + kv]
            out[pre + "self_attn.v_proj.bias"] = b[q + kv:]
            out[pre + "self_attn.o_proj.bias"] = f32(layer.b_o)
        if cfg.qk_norm:
            out[pre + "self_attn.q_norm.weight"] = f32(layer.q_norm)
            out[pre + "self_attn.k_norm.weight"] = f32(layer.k_norm)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def export_hf_directory(cfg: ModelConfig, params: ModelParams, out: str | Path) -> Path:
    """Write `out/` (config.json + model.safetensors, float32: bf16 weights are exact in it).
    The directory appears whole or not at all (built beside it, then renamed)."""
    from safetensors.numpy import save_file

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out}: already exists; export into a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=1))
        save_file(hf_tensors(cfg, params), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
