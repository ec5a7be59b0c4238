"""The same weights and prompts in transformers (the PyTorch peer): its greedy AR, its
prompt-lookup decoding and its assisted generation with an early-exit drafter (the model's own
first LAYERS layers and head: the drafter our `layerskip:LAYERS` is, so the two frameworks run one
speculative method; no smaller model shares SmolLM2's vocabulary), batch 1, exactly max_new_tokens
each, in the bench's dtype and on the GPU where torch sees one (torch and transformers are
optional dependencies, imported here only). Speculative peers draft PROMPT_LOOKUP_TOKENS tokens a
step, a constant number (transformers' assistant would otherwise vary it and stop drafting below
a confidence threshold), as our methods of that k do."""

from __future__ import annotations

import time
from pathlib import Path

from specjax.errors import ConfigError

PROMPT_LOOKUP_TOKENS = 4


class TransformersPeer:
    def __init__(self, model, **generate_kw):
        self.model, self.kw = model, generate_kw

    def generate(self, prompt: list[int], max_new: int) -> list[int]:
        import torch
        ids = torch.tensor([prompt], device=self.model.device)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                      min_new_tokens=max_new, do_sample=False, **self.kw)
        return out[0, len(prompt):].tolist()

    def timed(self, prompts: list[list[int]], max_new: int, repeats: int) -> tuple[list[float], list[list[int]]]:
        """Warm up on the first prompt, then `repeats` passes -> (tokens/s per pass, last pass's tokens)."""
        self.generate(prompts[0], max_new)
        rates, tokens = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            tokens = [self.generate(p, max_new) for p in prompts]
            rates.append(sum(len(x) for x in tokens) / (time.perf_counter() - t))
        return rates, tokens


def load_transformers_model(model, dtype: str = "float32"):
    """Our loaded model -> the transformers model of the same weight values in `dtype`, on the
    GPU if torch has one, eval mode. The weights go through an exported transformers directory
    (models/hf_export.py): transformers' own GGUF loader would keep them quantized and compute
    through the quantized form, a different model from the dense one we run."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ConfigError(f"the transformers peer needs torch and transformers ({e}); pip install 'specjax[dev]'") from None
    import tempfile

    from specjax.models.hf_export import export_hf_directory
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ConfigError(f"the transformers peer runs float32, bfloat16 or float16, not {dtype!r}")
    with tempfile.TemporaryDirectory(prefix="specjax-peer-") as tmp:
        path = export_hf_directory(model.cfg, model.params, Path(tmp) / "hf")
        peer = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    # No stop token in the protocol: min_new_tokens would suppress EOS and change the greedy choice
    # wherever EOS wins; drop EOS instead, as our stop_tokens=() does.
    peer.generation_config.eos_token_id = None
    return peer.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def make_peers(model, names: tuple[str, ...], dtype: str = "float32") -> dict[str, TransformersPeer]:
    """model: our LoadedModel (its weights, exported). names: as `bench.config.PEERS` spells them."""
    peer = load_transformers_model(model, dtype)
    out = {}
    for name in names:
        if name == "transformers_ar":
            out[name] = TransformersPeer(peer)
        elif name == "transformers_prompt_lookup":
            out[name] = TransformersPeer(peer, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
        elif name.startswith("transformers_early_exit:"):
            layers = int(name.split(":", 1)[1])
            if not 1 <= layers <= model.cfg.num_layers:
                raise ConfigError(f"peer {name}: the model has {model.cfg.num_layers} layers")
            out[name] = TransformersPeer(peer, assistant_early_exit=layers, num_assistant_tokens=PROMPT_LOOKUP_TOKENS,
                                         num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
        else:
            raise ConfigError(f"unknown peer {name!r}")
    return out
