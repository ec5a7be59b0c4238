"""The gemini proposer: asks a Gemini model (through `google-genai`, the successor of the end-of-life
`google-generativeai`; optional extra `specjax[llm]`, imported lazily) for configs in a direction.

The model's answer is constrained to a JSON schema derived from the spec, and then validated exactly like
user input: anything outside the space or violating a constraint is dropped and counted. Nothing it
returns is ever executed; it can only name values the spec already allows.
"""

from __future__ import annotations

import json
import os

from specjax.errors import ConfigError
from specjax.search.registry import REGISTRY
from specjax.search.spec import SearchSpec


def response_schema(spec: SearchSpec, n: int) -> dict:
    """JSON schema of the answer: {"configs": [{param: value, ...}, ...]} with each parameter's values."""
    props = {}
    for name, p in spec.space.items():
        values = list(p.grid())
        props[name] = {"type": "string" if p.kind == "categorical" else
                       ("integer" if p.kind == "int" else "number"), "enum": values}
    return {"type": "object", "required": ["configs"],
            "properties": {"configs": {"type": "array", "maxItems": n,
                                       "items": {"type": "object", "properties": props}}}}


def build_prompt(spec: SearchSpec, incumbent: dict, direction: str, n: int) -> str:
    movable = [p for p in REGISTRY.params_for(direction) if p in spec.space]
    space = {name: {"values": list(p.grid()), "active_when": {k: list(v) for k, v in p.when}}
             for name, p in spec.space.items()}
    return (
        "You tune a lossless speculative-decoding engine. Propose configurations that should raise "
        f"tokens per second.\nDeployment: {json.dumps(spec.deployment.fingerprint())}\n"
        f"Current best config: {json.dumps(incumbent)}\n"
        f"Direction: the cost component '{direction}' has the largest gap to its ceiling; "
        f"prefer changing {movable}.\nSpace: {json.dumps(space)}\n"
        f"Constraints: {[c.text for c in spec.constraints]}\n"
        f"Answer with at most {n} configs as JSON; include only parameters that are active.")


class GeminiProposer:
    def __init__(self, model: str = "gemini-2.5-flash", client=None, seed: int = 0):
        self.model, self.seed = model, seed
        self.client = client
        self.rejected = 0  # proposals dropped by validation
        self.errors: list[str] = []

    def _client(self):
        if self.client is None:
            try:
                from google import genai
            except ImportError:
                raise ConfigError("the gemini proposer needs the optional extra: pip install 'specjax[llm]'") from None
            key = os.environ.get("GEMINI_API_KEY") or os.environ.get("GOOGLE_API_KEY")
            if not key:
                raise ConfigError("the gemini proposer needs GEMINI_API_KEY (or GOOGLE_API_KEY) in the environment")
            self.client = genai.Client(api_key=key)
        return self.client

    def propose(self, spec, incumbent, direction, n, round_index, agent_index, seeds=()):
        from google.genai import types

        config = types.GenerateContentConfig(
            response_mime_type="application/json", response_json_schema=response_schema(spec, n),
            temperature=0.7, seed=self.seed + 1000 * round_index + agent_index)
        try:
            response = self._client().models.generate_content(
                model=self.model, contents=build_prompt(spec, incumbent, direction, n), config=config)
            answer = json.loads(response.text)
            proposals = answer["configs"]
            if not isinstance(proposals, list):
                raise TypeError("configs is not a list")
        except ConfigError:
            raise
        except Exception as e:  # a bad answer or a failed call costs this agent its round, not the search
            self.errors.append(f"round {round_index} agent {agent_index}: {type(e).__name__}: {e}")
            return [dict(s) for s in seeds]
        out = [dict(s) for s in seeds]
        for c in proposals[:n]:
            if not isinstance(c, dict):
                self.rejected += 1
                continue
            c = spec.canonical(c)
            if spec.is_valid(c):
                out.append(c)
            else:
                self.rejected += 1
        return out
