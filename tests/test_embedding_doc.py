"""docs/embedding.md's code blocks run, in order, in one namespace: the embedding guide cannot rot."""

from __future__ import annotations

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "embedding.md"


def test_embedding_guide_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name} block {i + 1}", "exec"), namespace)
    assert "finished" in namespace and len(namespace["finished"]) == 2
