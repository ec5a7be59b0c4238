"""Exporting a dense model to a transformers directory keeps every weight: a checkpoint written by
transformers, loaded by us and exported again, reads back to the same parameters, and transformers
computes the same logits from the export as from the original. An existing directory is never
overwritten."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import save_tiny_checkpoint
from specjax.models.hf_export import export_hf_directory
from specjax.models.loading import load_hf_directory


@pytest.mark.parametrize("tied", [False, True])
def test_export_round_trips_through_transformers(tmp_path, tied):
    import torch
    import transformers

    src = save_tiny_checkpoint(tmp_path / "src", seed=5)
    if tied:  # rewrite the source as a tied-embedding model
        model = transformers.AutoModelForCausalLM.from_pretrained(src)
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
        model.save_pretrained(tmp_path / "tied")
        src = tmp_path / "tied"
    cfg, params = load_hf_directory(src)
    out = export_hf_directory(cfg, params, tmp_path / "export")
    cfg2, params2 = load_hf_directory(out)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(src).eval()(ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    with pytest.raises(FileExistsError, match="already exists"):
        export_hf_directory(cfg, params, out)
