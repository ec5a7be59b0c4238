"""Search specs: the shipped ones load; bad ones fail with file:line and the key."""

from __future__ import annotations

import glob
import textwrap

import pytest

from specjax.errors import ConfigError
from specjax.search.spec import load_spec

GOOD = """\
version: 1
name: t
deployment:
  target: smollm2-135m
  prompts: {source: humaneval, n: 2}
stock: {drafter.kind: ngram, drafter.k: 4, drafter.ngram_max_n: 3}
space:
  drafter.kind: {type: categorical, values: [none, ngram, layerskip]}
  drafter.k: {type: int, range: [1, 8], when: {drafter.kind: [ngram, layerskip]}}
  drafter.ngram_max_n: {type: int, range: [2, 4], when: {drafter.kind: [ngram]}}
  drafter.layers: {type: int, values: [10, 20], when: {drafter.kind: [layerskip]}}
constraints:
  - "drafter.kind != 'layerskip' or drafter.k <= 4"
"""


def write(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(text))
    return str(p)


@pytest.mark.parametrize("path", sorted(glob.glob("search_specs/*.yaml")))
def test_shipped_specs_load(path):
    spec = load_spec(path)
    assert spec.space and spec.is_valid(spec.canonical(spec.stock))


def test_canonical_drops_inactive_and_constraints_hold(tmp_path):
    spec = load_spec(write(tmp_path, GOOD))
    c = spec.canonical({"drafter.kind": "none", "drafter.k": 3, "drafter.ngram_max_n": 2})
    assert c == {"drafter.kind": "none"}
    assert not spec.is_valid({"drafter.kind": "layerskip", "drafter.k": 6, "drafter.layers": 10})
    assert spec.is_valid({"drafter.kind": "layerskip", "drafter.k": 4, "drafter.layers": 10})


@pytest.mark.parametrize("old,new,where,needle", [
    ("name: t", "name: t\ncolour: red", ":3:", "colour: unknown key"),
    ("  target: smollm2-135m", "  target: 5", ":4:", "deployment.target: must be str"),
    ("  drafter.layers: {type: int, values: [10, 20]",
     "  drafter.wings: {type: int, values: [10, 20]", ":11:", "unknown mechanism parameter"),
    ("range: [1, 8]", "range: [8, 1]", ":9:", "is empty"),
    ("values: [none, ngram, layerskip]", "values: [none, ngram, medusa]", ":8:", "'medusa' is not allowed"),
    ("values: [none, ngram, layerskip]", "values: []", ":8:", "non-empty list"),
    ("when: {drafter.kind: [ngram]}", "when: {drafter.size: [ngram]}", ":10:", "unknown key"),
    ("drafter.k <= 4\"", "drafter.k <= 4\"\n  - \"drafter.k > 9\"", ":12:", "no configuration"),
    ("drafter.k <= 4\"", "drafter.q <= 4\"", ":13:", "unknown parameter 'drafter.q'"),
    ("drafter.k <= 4\"", "__import__('os')\"", ":13:", "may only call min, max, abs"),
    ("drafter.ngram_max_n: 3}", "drafter.ngram_max_n: 9}", ":6:", "outside [2, 4]"),
    ("  target: smollm2-135m", "  target: smollm2-135m\n  tp: 0", ":5:", "deployment.tp"),
])
def test_spec_errors_name_file_line_and_key(tmp_path, old, new, where, needle):
    text = GOOD.replace(old, new)
    assert text != GOOD
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_spec(path)
    msg = str(e.value)
    assert msg.startswith(path) and where in msg and needle in msg, msg


def test_invalid_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"s\.yaml:3: invalid YAML"):
        load_spec(write(tmp_path, "a: 1\nb: [1,\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_spec(str(tmp_path / "none.yaml"))


def test_tensor_parallel_deployment(tmp_path):
    spec = load_spec(write(tmp_path, GOOD.replace("  target: smollm2-135m", "  target: smollm2-135m\n  tp: 2")))
    assert spec.deployment.tp == 2 and spec.deployment.fingerprint()["tp"] == 2
    assert "tp" not in load_spec(write(tmp_path, GOOD)).deployment.fingerprint()  # old records still match
