"""The kernel path is width-invariant end to end: a verify step over W tokens computes, bit for bit,
what W AR steps compute (every layer's residual stream and the logits), on a fresh random bf16
model, in Pallas interpret mode. The check itself sees a width-dependent op when there is one."""

import jax

from conftest import tiny_config
from specjax.models.kernel_params import prepare_kernel_params
from specjax.models.params import init_random_params
from specjax.models.width_check import norm_vs_rows, ops_vs_width, step_vs_ar


def model():
    cfg = tiny_config(dtype="bfloat16", vocab_size=512, hidden_size=128, intermediate_size=384,
                      num_heads=4, num_kv_heads=2, head_dim=32)
    return cfg, init_random_params(cfg, jax.random.PRNGKey(11), scale=0.3)


def test_kernel_step_is_width_invariant():
    cfg, params = model()
    kparams, _ = prepare_kernel_params(params, cfg, interpret=True)
    step = step_vs_ar(kparams, cfg, width=5, prompt_len=20, batch=2)
    assert step["first_layer_differing"] == [None] * 5 and all(step["logits_equal"])
    assert all(ops_vs_width(kparams, cfg, width=5).values())
    norm = norm_vs_rows(kparams, cfg, width=5, batch=2, draws=10)
    assert norm["norm_impl"] == "interpret" and norm["differing_draws"]["model"] == 0, norm


def test_the_check_sees_a_width_dependent_step(monkeypatch):
    from specjax.models import transformer
    cfg, params = model()
    plain = transformer.linear
    # an op whose result depends on how many tokens came with it (as a reduction could)
    monkeypatch.setattr(transformer, "linear", lambda x, w: plain(x, w) * (1 + 2.0 ** -7 * (x.shape[1] > 1)))
    step = step_vs_ar(params, cfg, width=3, prompt_len=20)
    assert step["first_layer_differing"] == [0, 0, 0] and not any(step["logits_equal"])


def test_kernel_path_normalizes_with_the_row_invariant_kernel(monkeypatch):
    """XLA's RMSNorm of a row can change with the row count (tests/test_rms_norm.py): the kernel
    path must route every norm (layers and final) through the kernel instead."""
    from specjax.models import transformer
    cfg, params = model()
    kparams, _ = prepare_kernel_params(params, cfg, interpret=True)
    calls = []
    kernel = transformer.rms_norm_kernel
    monkeypatch.setattr(transformer, "rms_norm_kernel", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    step_vs_ar(kparams, cfg, width=2, prompt_len=8)
    per_forward = 2 * cfg.num_layers + 1
    assert len(calls) >= per_forward and len(calls) % per_forward == 0
