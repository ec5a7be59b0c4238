"""The gemini proposer through the real google-genai SDK against a fake HTTP transport (no network):
the request carries the spec's JSON schema, and the answer is validated like user input."""

from __future__ import annotations

import json
import textwrap

import httpx2 as httpx  # the HTTP client google-genai 3.x is built on
import pytest
from google import genai
from google.genai import types

from specjax.errors import ConfigError
from specjax.search.gemini import GeminiProposer, response_schema
from specjax.search.spec import load_spec
from test_search_spec import GOOD


@pytest.fixture
def spec(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(GOOD))
    return load_spec(str(p))


def fake_client(answer_text, seen):
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        body = {"candidates": [{"content": {"role": "model", "parts": [{"text": answer_text}]},
                                "finishReason": "STOP"}]}
        return httpx.Response(200, json=body)
    http = httpx.Client(transport=httpx.MockTransport(handler))
    return genai.Client(api_key="test-key", http_options=types.HttpOptions(httpx_client=http))


def test_answers_are_schema_constrained_and_validated(spec):
    answer = {"configs": [
        {"drafter.kind": "ngram", "drafter.k": 3, "drafter.ngram_max_n": 2},  # valid
        {"drafter.kind": "layerskip", "drafter.k": 8, "drafter.layers": 10},  # violates k <= 4
        {"drafter.kind": "medusa"},  # not in the space
        {"drafter.kind": "none", "drafter.k": 5},  # inactive k is dropped, then valid
        "rm -rf /",  # not even a config
    ]}
    seen = []
    proposer = GeminiProposer(client=fake_client(json.dumps(answer), seen))
    out = proposer.propose(spec, spec.stock, "verify", 8, round_index=0, agent_index=0)
    assert out == [{"drafter.kind": "ngram", "drafter.k": 3, "drafter.ngram_max_n": 2}, {"drafter.kind": "none"}]
    assert proposer.rejected == 3
    gen_cfg = seen[0]["generationConfig"]
    assert gen_cfg["responseMimeType"] == "application/json"
    assert gen_cfg["responseJsonSchema"] == json.loads(json.dumps(response_schema(spec, 8)))
    assert "drafter.k" in seen[0]["contents"][0]["parts"][0]["text"]


def test_malformed_answer_costs_the_round_not_the_search(spec):
    proposer = GeminiProposer(client=fake_client("this is not json", []))
    assert proposer.propose(spec, spec.stock, "draft", 4, 1, 0) == []
    assert proposer.errors and "round 1 agent 0" in proposer.errors[0]


def test_missing_key_is_a_clear_error(spec, monkeypatch):
    monkeypatch.delenv("GEMINI_API_KEY", raising=False)
    monkeypatch.delenv("GOOGLE_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="GEMINI_API_KEY"):
        GeminiProposer().propose(spec, spec.stock, "draft", 4, 0, 0)
