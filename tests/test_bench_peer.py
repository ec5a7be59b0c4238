"""The transformers peers (bench/peer.py) run our very weights: on a tiny float32 model its greedy
AR, prompt lookup and early-exit assisted generation (its own first layers drafting, the drafter
our `layerskip` is) give our AR's tokens wherever no near-tie can flip a choice; our layerskip
decoder gives them too; a bad peer name is refused by field."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from conftest import tiny_model
from specjax.bench.config import bench_config_from_dict
from specjax.bench.peer import make_peers
from specjax.decoding.sequences import GenerationConfig
from specjax.drafters.model_drafter import layer_skip_drafter
from specjax.engine import Decoder
from specjax.errors import ConfigError

MARGIN = 1e-4  # torch and XLA float32 sums differ in the last bits


def test_peers_give_our_ar_tokens(monkeypatch):
    pytest.importorskip("transformers")
    from transformers.generation import candidate_generator as cg
    drafted = []  # the early-exit peer drafts through transformers' early-exit generator
    original = cg.EarlyExitCandidateGenerator.get_candidates

    def spy(self, *a, **kw):
        drafted.append(self.assistant_early_exit)
        return original(self, *a, **kw)
    monkeypatch.setattr(cg.EarlyExitCandidateGenerator, "get_candidates", spy)
    cfg, params = tiny_model(seed=11, scale=0.8)
    rng = np.random.default_rng(3)
    # repetitive prompts, so that prompt lookup and the early exit find drafts to accept
    prompts = [np.tile(rng.integers(0, cfg.vocab_size, 5), 4).tolist() for _ in range(3)]
    gen = GenerationConfig(max_new_tokens=12)
    reference = Decoder(cfg, params, gen).generate(prompts)
    clear = [i for i, m in enumerate(reference.margins) if min(m) >= MARGIN]
    assert clear, "no prompt without a near-tie: pick another seed"
    ours = Decoder(cfg, params, gen, drafter=layer_skip_drafter(params, cfg, 2, k=4)).generate(prompts)
    assert [ours.tokens[i] for i in clear] == [reference.tokens[i] for i in clear]
    names = ("transformers_ar", "transformers_prompt_lookup", "transformers_early_exit:2")
    peers = make_peers(SimpleNamespace(cfg=cfg, params=params), names, "float32")
    assert sorted(peers) == sorted(names)
    for name, peer in peers.items():
        rates, tokens = peer.timed(prompts, 12, 1)
        assert len(rates) == 1 and rates[0] > 0
        assert [tokens[i] for i in clear] == [reference.tokens[i] for i in clear], name
    assert drafted and set(drafted) == {2}
    with pytest.raises(ConfigError, match="has 3 layers"):
        make_peers(SimpleNamespace(cfg=cfg, params=params), ("transformers_early_exit:4",))


@pytest.mark.parametrize("name", ["transformers_early_exit", "transformers_early_exit:x", "transformers_early_exit:0",
                                  "vllm"])
def test_bad_peer_names_are_refused(name):
    with pytest.raises(ConfigError, match=r"peers\[0\]: unknown peer"):
        bench_config_from_dict({"deployment": "x", "peers": [name]})
