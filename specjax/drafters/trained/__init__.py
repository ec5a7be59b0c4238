"""Trained block drafters that ship with specjax, and their recorded acceptance profiles.

`<model>-block<B>.safetensors`: a block drafter for registry model <model> at block size B (k = B - 1
drafts per round), exported by `specjax train-drafter` (recipe: benchmarks/train_drafter_h200.sh).
`<model>-block<B>.profile.json`: its conditional acceptance per draft position on held-out prompts,
which the acceptance-replay drafter borrows (`replay:<model>-block<B>:LAYERS`).
"""

from __future__ import annotations

from pathlib import Path

from specjax.errors import ConfigError

HERE = Path(__file__).resolve().parent


def available() -> list[str]:
    """Names (`<model>-block<B>`) of the shipped drafters."""
    return sorted(p.name[:-len(".safetensors")] for p in HERE.glob("*-block*.safetensors"))


def drafter_path(model: str, block_size: int) -> Path:
    name = f"{model}-block{block_size}"
    path = HERE / f"{name}.safetensors"
    if not path.is_file():
        raise ConfigError(f"no trained block drafter for {model!r} at block size {block_size} (k = "
                          f"{block_size - 1}); shipped: {', '.join(available()) or 'none'}. Train one with "
                          f"`specjax train-drafter`, or use block:DIR or block:random")
    return path


def profile_path(name: str) -> Path:
    path = HERE / f"{name}.profile.json"
    if not path.is_file():
        shipped = sorted(p.name[:-len(".profile.json")] for p in HERE.glob("*.profile.json"))
        raise ConfigError(f"no recorded acceptance profile {name!r}; shipped: {', '.join(shipped) or 'none'}")
    return path
