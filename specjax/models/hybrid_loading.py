"""Load the hybrid target from a transformers Qwen3-Next checkpoint directory (`config.json` +
`model.safetensors` or a sharded `model.safetensors.index.json`), HF tensor names.

Linear weights arrive torch-style [out, in] and are stored [in, out]; the GDN's in_proj_qkvz and
in_proj_ba, and the attention's q_proj (query and output gate interleaved per head), k_proj and v_proj,
are fused into one matrix each with their columns regrouped (layouts in `gated_deltanet.py` and
`hybrid.AttnLayerParams`). Tensors the model does not use (e.g. multi-token-prediction `mtp.*`) are
ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from specjax.errors import ModelFormatError
from specjax.models.gated_deltanet import GDNParams
from specjax.models.hybrid import AttnLayerParams, GDNLayerParams, HybridParams
from specjax.models.hybrid_config import HybridConfig, from_hf_dict


def load_hybrid(path: str | Path, dtype: str = "float32") -> tuple[HybridConfig, HybridParams]:
    from specjax.models.loading import read_config_json
    path = Path(path)
    cfg_dict, cfg_file = read_config_json(path)
    cfg = from_hf_dict(cfg_dict, where=str(cfg_file), dtype=dtype)
    return cfg, assemble_hybrid_params(cfg, _tensor_reader(path), str(path))


def _tensor_reader(path: Path):
    """-> get(name) -> float32 np.ndarray, over the directory's safetensors file(s)."""
    from safetensors import safe_open

    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            files = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ModelFormatError(f"{index_file}: unreadable index: {e}") from None
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ModelFormatError(f"{path}: no model.safetensors or model.safetensors.index.json")
    handles, owner = {}, {}
    for f in files:
        try:
            handles[f] = safe_open(str(path / f), framework="numpy")
        except FileNotFoundError:
            raise ModelFormatError(f"{path / f}: shard listed in the index is missing") from None
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelFormatError(f"{path / f}: unreadable safetensors file: {e}") from None
        owner.update({name: f for name in handles[f].keys()})

    def get(name: str) -> np.ndarray:
        if name not in owner:
            raise ModelFormatError(f"{path}: tensor {name!r} is missing from the checkpoint "
                                   f"({', '.join(files)})")
        try:
            return handles[owner[name]].get_tensor(name).astype(np.float32)
        except Exception as e:
            raise ModelFormatError(f"{path / owner[name]}: cannot read tensor {name!r}: {e}") from None

    return get


def _gdn_in_proj(cfg: HybridConfig, qkvz: np.ndarray, ba: np.ndarray) -> np.ndarray:
    """in_proj_qkvz [2*Hk*dk + 2*Hv*dv, D], in_proj_ba [2*Hv, D] (torch) -> w_in [D, in_proj_size]
    with columns q | k | v | z | b | a. transformers lays each out per key head: [q dk, k dk, v r*dv,
    z r*dv] and [b r, a r] with r = Hv // Hk value heads per key head."""
    Hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.value_heads_per_key_head
    D = cfg.hidden_size
    groups = qkvz.T.reshape(D, Hk, 2 * dk + 2 * r * dv)
    q, k, v, z = np.split(groups, np.cumsum([dk, dk, r * dv]), axis=-1)
    b, a = np.split(ba.T.reshape(D, Hk, 2 * r), 2, axis=-1)
    return np.concatenate([x.reshape(D, -1) for x in (q, k, v, z, b, a)], axis=1)


def _attn_qgkv(cfg: HybridConfig, q_proj: np.ndarray, k_proj: np.ndarray, v_proj: np.ndarray) -> np.ndarray:
    """q_proj [H * 2 * hd, D] (per head: query hd, then gate hd), k/v_proj [Hkv * hd, D]
    -> [D, 2 * q_size + 2 * kv_size] with columns query | gate | key | value."""
    D = cfg.hidden_size
    q, gate = np.split(q_proj.T.reshape(D, cfg.num_heads, 2 * cfg.head_dim), 2, axis=-1)
    return np.concatenate([q.reshape(D, -1), gate.reshape(D, -1), k_proj.T, v_proj.T], axis=1)


def assemble_hybrid_params(cfg: HybridConfig, get, where: str) -> HybridParams:
    """Build HybridParams from `get(name) -> np.ndarray` (HF names and torch layouts), checking every
    tensor's shape against the config."""
    dtype = jnp.dtype(cfg.dtype)
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    K, Hv = cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads

    def tensor(name, shape):
        x = get(name)
        if tuple(x.shape) != tuple(shape):
            raise ModelFormatError(f"{where}: tensor {name} has shape {tuple(x.shape)}, "
                                   f"expected {tuple(shape)} from the config")
        return x

    def arr(x):
        return jnp.asarray(x, dtype=dtype)

    def mlp(pre):
        gate = tensor(pre + "mlp.gate_proj.weight", (F, D))
        up = tensor(pre + "mlp.up_proj.weight", (F, D))
        return dict(mlp_norm=arr(tensor(pre + "post_attention_layernorm.weight", (D,))),
                    w_gate_up=arr(np.concatenate([gate.T, up.T], axis=1)),
                    w_down=arr(tensor(pre + "mlp.down_proj.weight", (D, F)).T))

    def gdn(pre):
        qkvz = tensor(pre + "in_proj_qkvz.weight", (2 * cfg.key_dim + 2 * cfg.value_dim, D))
        ba = tensor(pre + "in_proj_ba.weight", (2 * Hv, D))
        conv = tensor(pre + "conv1d.weight", (cfg.conv_dim, 1, K))
        return GDNParams(
            w_in=arr(_gdn_in_proj(cfg, qkvz, ba)), conv_w=arr(conv[:, 0, :].T),
            A_log=arr(tensor(pre + "A_log", (Hv,))), dt_bias=arr(tensor(pre + "dt_bias", (Hv,))),
            norm=arr(tensor(pre + "norm.weight", (cfg.linear_value_head_dim,))),
            w_out=arr(tensor(pre + "out_proj.weight", (D, cfg.value_dim)).T))

    def attention(pre):
        q = tensor(pre + "q_proj.weight", (2 * cfg.q_size, D))
        k = tensor(pre + "k_proj.weight", (cfg.kv_size, D))
        v = tensor(pre + "v_proj.weight", (cfg.kv_size, D))
        return dict(w_qgkv=arr(_attn_qgkv(cfg, q, k, v)),
                    q_norm=arr(tensor(pre + "q_norm.weight", (cfg.head_dim,))),
                    k_norm=arr(tensor(pre + "k_norm.weight", (cfg.head_dim,))),
                    w_o=arr(tensor(pre + "o_proj.weight", (D, cfg.q_size)).T))

    layers = []
    for i, kind in enumerate(cfg.layer_types):
        pre = f"model.layers.{i}."
        in_norm = arr(tensor(pre + "input_layernorm.weight", (D,)))
        if kind == "full_attention":
            layers.append(AttnLayerParams(in_norm=in_norm, **attention(pre + "self_attn."), **mlp(pre)))
        else:
            layers.append(GDNLayerParams(in_norm=in_norm, gdn=gdn(pre + "linear_attn."), **mlp(pre)))
    lm_head = None if cfg.tie_word_embeddings else arr(tensor("lm_head.weight", (V, D)).T)
    return HybridParams(embed=arr(tensor("model.embed_tokens.weight", (V, D))), layers=layers,
                        final_norm=arr(tensor("model.norm.weight", (D,))), lm_head=lm_head)
