"""Hybrid (Gated DeltaNet + attention) targets in the serving engine (serving/hybrid_step.py):
per-slot recurrent state, slots recycled while others run; every request passes token forcing
and free-running equals the decoder's AR, chains and trees, over gathered page views or the
paged attention kernel."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.decoding.sequences import GenerationConfig
from specjax.drafters.ngram import NgramDrafter
from specjax.engine import Decoder
from specjax.serving import ServingEngine, ServingOptions
from specjax.trees.builders import TreeSpec
from test_serving import TOL, assert_forcing, random_prompts


@pytest.fixture(scope="module")
def hybrid():
    import jax
    from specjax.models.hybrid import init_random_hybrid_params
    from test_hybrid_decoding import hybrid_config
    cfg = hybrid_config(303)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(3))
    rng = np.random.default_rng(5)
    prompts = random_prompts(rng, 5, 8, 2, 14)
    gen = GenerationConfig(max_new_tokens=14)
    return cfg, params, prompts, Decoder(cfg, params, gen).generate(prompts)


MODES = {"chain": ServingOptions(), "chain_device_loop": ServingOptions(steps_per_call=8),
         "chain_budget": ServingOptions(budget=3), "chain_two_level": ServingOptions(two_level_k1=1),
         "tree": ServingOptions(tree=TreeSpec("topk", 5, 3), steps_per_call=4),
         "tree_budget_two_level": ServingOptions(tree=TreeSpec("topk", 5, 3), budget=6, two_level_k1=2),
         "chain_packed": ServingOptions(packed=True), "chain_budget_packed": ServingOptions(budget=2, packed=True),
         "tree_budget_packed": ServingOptions(tree=TreeSpec("topk", 5, 3), budget=4, packed=True),
         "all": ServingOptions(tree=TreeSpec("topk", 5, 3), budget=5, packed=True, two_level_k1=2,
                               steps_per_call=4),
         "chain_two_level_cut": ServingOptions(budget=5, packed=True, two_level_k1=1, two_level_tokens=1,
                                               steps_per_call=4)}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_hybrid_requests_pass_forcing(hybrid, mode):
    cfg, params, prompts, reference = hybrid
    opts = MODES[mode]
    engine = ServingEngine(cfg, params, NgramDrafter(k=3, vocab_size=cfg.vocab_size), num_slots=2,
                           slot_len=48, page_size=8, options=opts, forcing=True)
    assert_forcing(engine, prompts, reference, 14)


def test_hybrid_plain_ar_passes_forcing_and_forcing_catches_a_wrong_token(hybrid):
    """Plain AR on a hybrid target runs forced along the reference (slots recycled, device
    loop); a reference with one token changed is caught at that token, as a failure (the
    real margin there is no tie), and the request after it still passes."""
    import dataclasses
    from specjax.serving.forcing import check_serving_forcing
    cfg, params, prompts, reference = hybrid

    def engine():
        return ServingEngine(cfg, params, None, num_slots=2, slot_len=48, page_size=8,
                             options=ServingOptions(steps_per_call=3), forcing=True)

    report = assert_forcing(engine(), prompts, reference, 14)
    assert report.checked == report.expected
    row, pos = 1, 5
    tokens = [list(t) for t in reference.tokens]
    right = tokens[row][pos]
    tokens[row][pos] = (right + 1) % cfg.vocab_size
    wrong = dataclasses.replace(reference, tokens=tokens)
    report = check_serving_forcing(engine(), prompts, wrong, 14, tolerance=TOL)
    assert not report.passed
    first = min((m for m in report.failures if m.prompt == row), key=lambda m: m.position)
    assert (first.position, first.engine_token, first.reference_token) == (pos, right, tokens[row][pos])
    assert {m.prompt for m in report.failures} == {row}


def test_hybrid_kernels_with_every_mechanism_pass_forcing(hybrid):
    """The decoder's attention and tree-GDN kernels (interpret mode) inside the packed two-level
    tree step with the budget and device-resident steps."""
    import dataclasses
    cfg, params, prompts, reference = hybrid
    opts = ServingOptions(tree=TreeSpec("topk", 5, 3), budget=4, packed=True, two_level_k1=2, steps_per_call=4)
    engine = ServingEngine(cfg, dataclasses.replace(params, kernels="interpret"),
                           NgramDrafter(k=3, vocab_size=cfg.vocab_size), num_slots=2, slot_len=48, page_size=8,
                           options=opts, forcing=True)
    assert_forcing(engine, prompts, reference, 14)


def test_serving_decoder_runs_a_hybrid_target_on_its_kernels(hybrid):
    """ServingDecoder(kernels="interpret") on a hybrid target: the decoder's attention and tree-GDN
    kernels (its GEMMs stay XLA's, as engine.Decoder runs them), with the paged kernel; token
    forcing against that engine's AR passes."""
    from specjax.forcing import check_token_forcing
    from specjax.serving.decoder import ServingDecoder
    cfg, params, prompts, _ = hybrid
    gen = GenerationConfig(max_new_tokens=14)
    reference = Decoder(cfg, params, gen, kernels="interpret").generate(prompts)
    dec = ServingDecoder(cfg, params, gen, NgramDrafter(k=3, vocab_size=cfg.vocab_size), num_slots=2, page_size=8,
                         options=ServingOptions(packed=True, budget=4, tree=TreeSpec("topk", 5, 3),
                                                attention="interpret"), kernels="interpret")
    assert dec.params.kernels == "interpret"
    report = check_token_forcing(dec, prompts, reference, tolerance=TOL)
    assert report.passed, report.summary()


@pytest.mark.parametrize("tree,attention", [(None, "xla"), (TreeSpec("topk", 5, 3), "xla"),
                                            (TreeSpec("topk", 5, 3), "interpret")])
def test_hybrid_failing_request_fails_alone_when_packed(hybrid, tree, attention):
    """A poisoned request (NaN embedding row) in slot 0, whose tokens come first in the packed
    bucket, fails; the request beside it still equals AR (the bucket's padding never carries one
    slot's values into another's GDN tree or attention; with the paged kernel, the failed
    request's NaN K/V left in pages and the trash page never reach a live row)."""
    import dataclasses
    cfg, params, prompts, reference = hybrid
    poison = cfg.vocab_size - 1
    bad_params = dataclasses.replace(params, embed=params.embed.at[poison].set(float("nan")))
    opts = ServingOptions(tree=tree, budget=3, packed=True, two_level_k1=1, steps_per_call=4, attention=attention)
    engine = ServingEngine(cfg, bad_params, NgramDrafter(k=3, vocab_size=cfg.vocab_size), num_slots=2,
                           slot_len=48, page_size=8, options=opts)
    good = [p for p in range(len(prompts)) if poison not in prompts[p]][0]
    bad, ok = engine.submit([1, 2, poison, 3], 14), engine.submit(prompts[good], 14)
    results = engine.run()
    assert results[bad].status == "failed"
    assert results[ok].status == "finished" and results[ok].tokens == reference.tokens[good]


def test_hybrid_free_running_equals_ar_with_slots_recycled(hybrid):
    cfg, params, prompts, reference = hybrid
    ngram = NgramDrafter(k=3, vocab_size=cfg.vocab_size)
    for drafter, opts in ((None, ServingOptions(steps_per_call=3)), (ngram, ServingOptions(steps_per_call=3)),
                          (ngram, ServingOptions(steps_per_call=3, packed=True, budget=3))):
        engine = ServingEngine(cfg, params, drafter, num_slots=2, slot_len=48, page_size=8, options=opts)
        rids = [engine.submit(p, 14) for p in prompts]
        results = engine.run()
        assert [results[r].tokens for r in rids] == reference.tokens


PAGED = {"ar": (None, ServingOptions(attention="interpret", steps_per_call=4)),
         "chain": (3, ServingOptions(attention="interpret")),
         "tree_budget_two_level": (3, ServingOptions(tree=TreeSpec("topk", 5, 3), budget=6, two_level_k1=2,
                                                     attention="interpret")),
         "all": (3, ServingOptions(tree=TreeSpec("topk", 5, 3), budget=5, packed=True, two_level_k1=2,
                                   steps_per_call=4, attention="interpret"))}


@pytest.mark.parametrize("mode", sorted(PAGED))
def test_hybrid_paged_attention_kernel_passes_forcing(hybrid, mode):
    """The attention layers on the ragged paged kernel (interpret mode), reading and writing the
    page pools in place (no gathered views): every request passes token forcing, plain AR,
    chains and trees, with the budget, packing, two levels and device-resident steps; pages of 4
    positions, so a kernel block spans many pages; the decoder's own GDN kernels in "all"."""
    import dataclasses
    cfg, params, prompts, reference = hybrid
    k, opts = PAGED[mode]
    if mode == "all":
        params = dataclasses.replace(params, kernels="interpret")
    drafter = None if k is None else NgramDrafter(k=k, vocab_size=cfg.vocab_size)
    engine = ServingEngine(cfg, params, drafter, num_slots=2, slot_len=48, page_size=4, options=opts, forcing=True)
    assert_forcing(engine, prompts, reference, 14)


@pytest.mark.parametrize("tree", [None, TreeSpec("topk", 6, 4)])
def test_hybrid_two_level_gives_the_one_level_step(tree):
    """Two-level verification on a hybrid target (level 2 over the later drafts only, on level 1's
    K/V and GDN inputs) serves exactly the one-level tokens and acceptance, and level 2 ran: the
    one-level engine committed more than k1 + 1 tokens in some step."""
    import jax
    from specjax.models.hybrid import init_random_hybrid_params
    from test_hybrid_decoding import hybrid_config, repetitive_prompts
    cfg = hybrid_config(41)
    params = init_random_hybrid_params(cfg, jax.random.PRNGKey(4))
    prompts = repetitive_prompts(np.random.default_rng(8), 5, cfg.vocab_size)
    gen = GenerationConfig(max_new_tokens=16)
    reference = Decoder(cfg, params, gen).generate(prompts).tokens
    served = []
    for k1 in (None, 1):
        engine = ServingEngine(cfg, params, NgramDrafter(k=4, vocab_size=cfg.vocab_size), num_slots=2,
                               slot_len=64, page_size=8, options=ServingOptions(tree=tree, two_level_k1=k1))
        rids = [engine.submit(p, 16) for p in prompts]
        results = engine.run()
        assert [results[r].tokens for r in rids] == reference
        served.append([(results[r].committed, results[r].rounds, results[r].accepted_hist.tolist())
                       for r in rids])
    assert served[1] == served[0]
    assert sum(sum(h[2:]) for _, _, h in served[0]) > 0  # steps that committed >= 3 tokens
