"""Which code produced a result: the commit recorded in benchmarks and memory records."""

import re
import shutil

import pytest

from specjax.provenance import code_commit


def test_env_names_the_commit_where_the_tree_has_no_git(monkeypatch):
    monkeypatch.setenv("SPECJAX_COMMIT", "1234abc")
    assert code_commit() == "1234abc"


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_checkout_reports_its_head(monkeypatch):
    monkeypatch.delenv("SPECJAX_COMMIT", raising=False)
    got = code_commit()
    assert got == "unknown" or re.fullmatch(r"[0-9a-f]{7,40}", got)
