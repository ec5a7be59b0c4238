"""Which code produced a result: the commit recorded in benchmarks and memory records."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from specjax.provenance import code_commit

ROOT = Path(__file__).resolve().parents[1]


def test_env_names_the_commit_where_the_tree_has_no_git(monkeypatch):
    monkeypatch.setenv("SPECJAX_COMMIT", "1234abc")
    assert code_commit() == "1234abc"


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="not a git checkout")
def test_checkout_reports_its_head(monkeypatch):
    monkeypatch.delenv("SPECJAX_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    got = code_commit()
    assert re.fullmatch(r"[0-9a-f]{7,40}", got) and head.startswith(got)
