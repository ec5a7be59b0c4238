"""Proposers: where candidate configs come from. Each agent gets a direction (the cost component with
a large gap) and returns configs; the loop validates every proposal against the spec like user input.

- offline (default, no network): local search around the incumbent on the parameters that move the
  direction's component, plus a little random exploration, plus configs seeded from memory records.
- replay: configs read from a JSON file ({"rounds": [[config, ...], ...]}), for tests and reruns.
- gemini: a Gemini model through `google-genai` (search/gemini.py), answers validated like user input.
"""

from __future__ import annotations

import json
import random

from specjax.errors import ConfigError
from specjax.search.registry import REGISTRY
from specjax.search.spec import SearchSpec


class OfflineProposer:
    def __init__(self, seed: int = 0, explore: float = 0.2):
        self.seed, self.explore = seed, explore

    def propose(self, spec: SearchSpec, incumbent: dict, direction: str, n: int, round_index: int,
                agent_index: int, seeds: list[dict] = ()) -> list[dict]:
        rng = random.Random(hash((self.seed, round_index, agent_index, direction)) & 0xFFFFFFFF)
        movable = [p for p in REGISTRY.params_for(direction) if p in spec.space] or list(spec.space)
        out = [dict(s) for s in seeds]
        for _ in range(n * 4):
            if len(out) >= n:
                break
            if rng.random() < self.explore:
                out.append(spec.random_config(rng))
                continue
            config = dict(incumbent)
            for _ in range(rng.choice((1, 1, 2))):
                name = rng.choice(movable)
                grid = list(spec.space[name].grid())
                current = config.get(name)
                if current in grid and rng.random() < 0.7:  # a neighbour in the grid
                    i = grid.index(current) + rng.choice((-1, 1))
                    config[name] = grid[min(max(i, 0), len(grid) - 1)]
                else:
                    config[name] = rng.choice(grid)
                for child, p in spec.space.items():  # newly active children need a value
                    if p.active(config) and child not in config:
                        config[child] = rng.choice(p.grid())
            out.append(spec.canonical(config))
        return out


class ReplayProposer:
    def __init__(self, path: str):
        try:
            with open(path, encoding="utf-8") as f:
                self.rounds = json.load(f)["rounds"]
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"{path}: unreadable replay file: {e}") from None

    def propose(self, spec, incumbent, direction, n, round_index, agent_index, seeds=()):
        if agent_index != 0 or round_index >= len(self.rounds):
            return []
        return [dict(c) for c in self.rounds[round_index]]


def make_proposer(spec: SearchSpec, kind: str | None = None):
    kind = kind or spec.proposer
    if kind == "offline":
        return OfflineProposer(seed=int(spec.proposer_options.get("seed", 0)))
    if kind == "replay":
        path = spec.proposer_options.get("replay_file")
        if not path:
            raise ConfigError(f"{spec.path}: proposer.replay_file is required for the replay proposer")
        return ReplayProposer(path)
    if kind == "gemini":
        from specjax.search.gemini import GeminiProposer
        return GeminiProposer(model=spec.proposer_options.get("model", "gemini-2.5-flash"),
                              seed=int(spec.proposer_options.get("seed", 0)))
    raise ConfigError(f"unknown proposer {kind!r}")
