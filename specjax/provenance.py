"""Which code produced a result: the git commit, recorded with every benchmark and memory record."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def code_commit() -> str:
    """Short hash of HEAD; `SPECJAX_COMMIT` where the tree travels without .git (as to a lent GPU).
    "unknown" when neither is there."""
    if os.environ.get("SPECJAX_COMMIT"):
        return os.environ["SPECJAX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
