"""Memory store: round trip, idempotence, schema errors naming file and field, 200 random corruptions all
refused, interrupted writes leave the old state, parallel writers lose nothing, similarity order,
prune, and the `memory` CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import random
import threading

import pytest

from specjax.errors import SpecJaxError
from specjax.memory.cli import add_memory_parser
from specjax.memory.store import SCHEMA_VERSION, MemoryRecord, MemoryRecordError, MemoryStore, seed_configs

DEPLOY = {"target": "smollm2-135m", "hardware": "H200", "batch": 1, "prompts": "humaneval:20",
          "max_new_tokens": 128, "sampling": "greedy", "weight_format": "f32"}


def make(speedup=2.0, created="2025-06-01T12:00:00Z", spec="ngram-sweep", k=4, **deployment):
    return MemoryRecord(
        spec_name=spec, deployment={**DEPLOY, **deployment},
        config={"drafter.kind": "ngram", "drafter.k": k, "drafter.max_n": 3}, config_delta={"drafter.k": k},
        measured={"tokens_per_s": 100.0 * speedup, "speedup": speedup, "runs": 3, "device": "NVIDIA H200"},
        predicted={"tokens_per_s": 95.0 * speedup, "speedup": 0.95 * speedup},
        forcing={"checked": 2560, "expected": 2560, "failures": 0, "near_ties": 1, "tolerance": 1e-3},
        git_commit="dd51756", device="NVIDIA H200", created=created)


@pytest.fixture
def store(tmp_path):
    return MemoryStore(tmp_path / "mem")


def test_round_trip(store):
    rec = make()
    stored = store.put(rec)
    assert len(stored.record_id) == 16 and rec.record_id == ""  # the caller's record is not mutated
    assert dataclasses.replace(stored, record_id="") == rec
    got = store.get(stored.record_id)
    assert got == stored and got.deployment == DEPLOY and got.measured["speedup"] == 2.0
    on_disk = json.loads(store.path(stored.record_id).read_text())
    assert on_disk["schema_version"] == SCHEMA_VERSION and on_disk["checksum"][:16] == stored.record_id
    assert store.records() == ([stored], [])
    with pytest.raises(KeyError):
        store.get("0" * 16)
    with pytest.raises(MemoryRecordError, match="not a record id"):
        store.get("../../etc/passwd")


def test_put_is_idempotent_and_id_follows_content(store):
    a = store.put(make())
    mtime = store.path(a.record_id).stat().st_mtime_ns
    assert store.put(make()) == a and store.put(a) == a
    assert store.path(a.record_id).stat().st_mtime_ns == mtime  # not rewritten
    assert len(list(store.dir.iterdir())) == 1
    # An int where a float is expected is the same content (normalized), a different value is not.
    r = make()
    r.measured["speedup"] = 2
    assert store.put(r).record_id == a.record_id
    assert store.put(make(speedup=2.5)).record_id != a.record_id
    assert len(store.records()[0]) == 2


@pytest.mark.parametrize("mutate, field, message", [
    (lambda d: d.pop("git_commit"), "git_commit", "missing"),
    (lambda d: d["deployment"].pop("target"), "deployment.target", "missing"),
    (lambda d: d["measured"].pop("runs"), "measured.runs", "missing"),
    (lambda d: d.__setitem__("spec_name", 3), "spec_name", "expected a string"),
    (lambda d: d["deployment"].__setitem__("batch", "1"), "deployment.batch", "expected an integer"),
    (lambda d: d["measured"].__setitem__("runs", True), "measured.runs", "expected an integer"),
    (lambda d: d["measured"].__setitem__("speedup", "2x"), "measured.speedup", "expected a number"),
    (lambda d: d["predicted"].__setitem__("speedup", float("nan")), "predicted.speedup", "finite"),
    (lambda d: d["config"].__setitem__("drafter.k", [4]), "config.drafter.k", "expected a string"),
    (lambda d: d["deployment"].__setitem__("extra", None), "deployment.extra", "expected a string"),
    (lambda d: d.__setitem__("forcing", []), "forcing", "expected an object"),
    (lambda d: d["forcing"].__setitem__("failures", 2), "forcing.failures", "token-forcing failures"),
    (lambda d: d["forcing"].__setitem__("checked", 10), "forcing.checked", "positions checked"),
    (lambda d: d["predicted"].__setitem__("tokens", 1.0), "predicted.tokens", "unknown field"),
    (lambda d: d.__setitem__("speedup", 1.0), "speedup", "unknown field"),
    (lambda d: d.__setitem__("created", "yesterday"), "created", "ISO 8601"),
    (lambda d: d.__setitem__("created", "2025-06-01T12:00:00+02:00"), "created", "UTC"),
])
def test_schema_errors_name_the_field(store, mutate, field, message):
    d = make().to_json_dict()
    mutate(d)
    with pytest.raises(MemoryRecordError) as e:
        MemoryRecord.from_json_dict(d, "some/file.json")
    msg = str(e.value)
    assert msg.startswith("some/file.json: ") and f"'{field}'" in msg and message in msg, msg
    if set(d) == {f.name for f in dataclasses.fields(MemoryRecord)}:  # else not constructible in Python
        # put() refuses the same record before anything is written.
        with pytest.raises(MemoryRecordError, match=f"'{field}'"):
            store.put(MemoryRecord(**d))
        assert store.records() == ([], [])


def test_schema_error_in_a_file_names_the_file(store):
    """A file whose checksum matches but whose content breaks the schema (e.g. written by a buggy or
    newer writer): the error names the file and the field."""
    rec = store.put(make())
    path = store.path(rec.record_id)
    env = json.loads(path.read_text())
    del env["record"]["device"]
    from specjax.memory.store import _checksum, _file_text
    env["checksum"] = _checksum({k: v for k, v in env["record"].items() if k != "record_id"})
    path.write_text(_file_text(env))
    with pytest.raises(MemoryRecordError) as e:
        store.get(rec.record_id)
    assert str(path) in str(e.value) and "'device' is missing" in str(e.value)
    env["schema_version"] = 2
    path.write_text(_file_text(env))
    with pytest.raises(MemoryRecordError, match="'schema_version'.*not supported"):
        store.get(rec.record_id)


def corruptions(original: bytes, rng: random.Random, n: int):
    """n corrupted versions of a record file, every one different from the original."""
    env = json.loads(original)
    for i in range(n):
        kind = i % 5
        b = bytearray(original)
        if kind == 0:  # 1-3 bytes changed: one low bit flipped (stays ASCII) or any random change
            for _ in range(rng.randint(1, 3)):
                pos = rng.randrange(len(b))
                b[pos] ^= 1 << rng.randrange(7) if rng.random() < 0.7 else rng.randint(1, 255)
        elif kind == 1:  # truncate (a torn write)
            del b[rng.randrange(len(b)):]
        elif kind == 2:  # appended junk, sometimes only whitespace or a second JSON value
            b += rng.choice([b"\n", b" ", b"{}", b"\x00" * rng.randint(1, 64),
                             rng.randbytes(rng.randint(1, 64))])
        elif kind == 3:  # checksum deleted or blanked
            e = json.loads(original)
            if rng.random() < 0.5:
                del e["checksum"]
            else:
                e["checksum"] = ""
            b = bytearray(json.dumps(e, sort_keys=True, indent=2).encode() + b"\n")
        else:  # a plausible edit of one value, checksum left alone (a tampered or bit-rotted value)
            e = json.loads(original)
            section = rng.choice(["measured", "predicted", "deployment", "config"])
            key = rng.choice(sorted(e["record"][section]))
            value = e["record"][section][key]
            e["record"][section][key] = value + "x" if isinstance(value, str) else value + 1
            b = bytearray(json.dumps(e, sort_keys=True, indent=2).encode() + b"\n")
        if bytes(b) == original:  # an XOR can't do this, but be sure every case is a real corruption
            b += b" "
        yield kind, bytes(b)
    assert env  # the original parsed


def test_200_random_corruptions_are_all_refused(store):
    rec = store.put(make())
    path = store.path(rec.record_id)
    original = path.read_bytes()
    rng = random.Random(0)
    for kind, data in corruptions(original, rng, 200):
        path.write_bytes(data)
        with pytest.raises(MemoryRecordError) as e:  # any other exception type fails the test
            got = store.get(rec.record_id)
            pytest.fail(f"corruption kind {kind} accepted: {data[:80]!r} -> {got}")
        assert str(path) in str(e.value) and "\n" not in str(e.value)
        good, bad = store.records()
        assert good == [] and [p for p, _ in bad] == [path], (kind, data)
    path.write_bytes(original)  # the checks above can pass: the original still reads
    assert store.get(rec.record_id) == rec


def test_put_repairs_a_corrupt_file_of_the_same_id(store):
    rec = store.put(make())
    store.path(rec.record_id).write_bytes(b"{")
    assert store.put(make()) == rec and store.get(rec.record_id) == rec


def test_interrupted_writes_leave_the_previous_state(store, monkeypatch):
    old = store.put(make(speedup=1.5))
    before = {p.name: p.read_bytes() for p in store.dir.iterdir()}
    # A writer that died after writing its temp file: ignored by readers, cleaned by prune.
    leftover = store.dir / f".{'a' * 16}.999.dead.tmp"
    leftover.write_bytes(before[f"{old.record_id}.json"][:100])
    # A crash between write and rename: put raises, nothing new is visible, its temp file is gone.
    def crash(src, dst):
        raise OSError("simulated crash before rename")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        store.put(make(speedup=3.0))
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in store.dir.iterdir() if p != leftover} == before
    assert store.records() == ([old], []) and store.get(old.record_id) == old
    assert store.prune(remove_corrupt=True) == [leftover] and not leftover.exists()
    assert store.put(make(speedup=3.0)).record_id in {p.stem for p in store.dir.glob("*.json")}


def _writer(root, worker, barrier):
    barrier.wait()  # start together so the writes really overlap
    s = MemoryStore(root)
    for i in range(25):
        s.put(make(speedup=1.0 + worker + i / 100, spec=f"w{worker}"))
        s.put(make(speedup=9.0, spec="shared"))  # the same record from every process, repeatedly


def test_parallel_writers_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("spawn")  # fork would copy JAX's threads from conftest
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path / "mem"), w, barrier)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    good, bad = MemoryStore(tmp_path / "mem").records()
    assert bad == [] and len(good) == 101
    assert sorted((r.spec_name, r.measured["speedup"]) for r in good if r.spec_name != "shared") == \
        sorted((f"w{w}", 1.0 + w + i / 100) for w in range(4) for i in range(25))
    assert not list((tmp_path / "mem" / "records").glob("*.tmp"))


def test_put_waits_while_prune_holds_the_store(store):
    """prune holds the store alone, so it can't delete a record a concurrent put reports as stored,
    nor the temp file of a put in flight."""
    store.put(make())
    done = threading.Event()
    writer = threading.Thread(target=lambda: (store.put(make(speedup=3.0)), done.set()))
    with store._lock(exclusive=True):
        writer.start()
        assert not done.wait(0.3)  # blocked on the lock
    writer.join(5)
    assert done.is_set() and len(store.records()[0]) == 2


def test_similar_orders_by_fingerprint_then_speedup(store):
    # Scores against DEPLOY (target and hardware weigh 3, the five other fields 1; 11 at most):
    same = store.put(make(speedup=2.0))  # 11
    exact_worse = store.put(make(speedup=1.2))  # 11, lower speedup
    same_better = store.put(make(speedup=2.5, batch=4))  # 10
    other_hw = store.put(make(speedup=3.0, hardware="A100", k=2))  # 8
    other_target_hw = store.put(make(speedup=4.0, target="llama-8b", hardware="A100", batch=8,
                                     prompts="mt-bench", sampling="t0.7", max_new_tokens=256))  # 1
    store.put(make(speedup=5.0, k=8, target="x", hardware="y", batch=2, prompts="p", max_new_tokens=1,
                   sampling="s", weight_format="w"))  # 0: never returned
    assert store.similar(DEPLOY) == [same, exact_worse, same_better, other_hw, other_target_hw]
    assert store.similar(DEPLOY, limit=2) == [same, exact_worse]
    # Target and hardware outweigh two other fields: for this query the records sharing target,
    # hardware and weight format (7) beat the one sharing the four other fields (5).
    q = {**DEPLOY, "batch": 8, "prompts": "mt-bench", "sampling": "t0.7", "max_new_tokens": 256}
    assert store.similar(q) == [same_better, same, exact_worse, other_target_hw, other_hw]
    assert store.similar({"target": "nobody"}) == []
    assert store.similar({"batch": True}) == []  # True is not the integer 1
    # Seeding a new search: full configs of the most similar records, best first, duplicates dropped.
    assert seed_configs(store, DEPLOY, limit=3) == [same.config, other_hw.config]
    assert seed_configs(store, DEPLOY, limit=1) == [same.config]


def test_prune(store):
    old = store.put(make(speedup=1.0, created="2020-01-01T00:00:00Z"))
    best = store.put(make(speedup=3.0, created="2999-01-01T00:00:00Z"))
    mid = store.put(make(speedup=2.0, created="2999-01-02T00:00:00Z"))
    elsewhere = store.put(make(speedup=1.1, created="2999-01-01T00:00:00Z", hardware="A100"))
    corrupt = store.dir / f"{'f' * 16}.json"
    corrupt.write_text("{not json")
    p = store.path

    assert store.prune(keep_best_per_deployment=1, dry_run=True) == sorted([p(old.record_id),
                                                                            p(mid.record_id)])
    assert len(store.records()[0]) == 4 and corrupt.exists()  # a dry run removes nothing
    assert store.prune(older_than_days=365) == [p(old.record_id)]
    assert store.prune(keep_best_per_deployment=1) == [p(mid.record_id)]
    assert {r.record_id for r in store.records()[0]} == {best.record_id, elsewhere.record_id}
    assert corrupt.exists()  # only removed when asked
    assert store.prune(remove_corrupt=True) == [corrupt] and store.records()[1] == []
    assert store.prune(keep_best_per_deployment=1, older_than_days=0.5) == []  # the rest is in the future
    with pytest.raises(SpecJaxError, match="at least 1"):
        store.prune(keep_best_per_deployment=0)
    assert MemoryStore(store.root / "nothing").prune(remove_corrupt=True) == []


def run_cli(capsys, *argv):
    parser = argparse.ArgumentParser(prog="specjax")
    add_memory_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["memory", *argv])
    capsys.readouterr()
    code = args.func(args)
    return code, capsys.readouterr().out


def test_cli_list_show_prune(store, capsys):
    a = store.put(make(speedup=2.25))
    b = store.put(make(speedup=1.5, k=2, created="2025-06-02T12:00:00Z", hardware="A100"))
    root = str(store.root)
    code, out = run_cli(capsys, "list", "--store", root)
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:4] == ["id", "created", "spec", "target"]
    assert lines[1].split() == [a.record_id, a.created, "ngram-sweep", "smollm2-135m", "H200", "2.25x/2.14x",
                                "drafter.k=4"]
    assert lines[2].startswith(b.record_id) and "A100" in lines[2] and "drafter.k=2" in lines[2]
    assert lines[-1].startswith("2 records, 0 corrupt")

    code, out = run_cli(capsys, "show", a.record_id, "--store", root)
    assert code == 0 and MemoryRecord.from_json_dict(json.loads(out), "stdout") == a

    bad = store.path(b.record_id)
    bad.write_bytes(bad.read_bytes()[:-10])
    code, out = run_cli(capsys, "list", "--store", root)
    assert code == 1 and f"CORRUPT {bad}: not valid JSON" in out and a.record_id in out
    with pytest.raises(MemoryRecordError, match=str(bad)):
        run_cli(capsys, "show", b.record_id, "--store", root)

    code, out = run_cli(capsys, "prune", "--store", root, "--remove-corrupt", "--dry-run")
    assert code == 0 and f"would remove {bad}" in out and bad.exists()
    code, out = run_cli(capsys, "prune", "--store", root, "--remove-corrupt", "--keep-best", "1")
    assert code == 0 and f"removed {bad}" in out and not bad.exists()
    assert out.splitlines()[-1] == "removed 1 files"

    with pytest.raises(SpecJaxError, match="at least one of"):
        run_cli(capsys, "prune", "--store", root)
    with pytest.raises(SpecJaxError, match="directory not found"):
        run_cli(capsys, "list", "--store", root + "-typo")
    with pytest.raises(KeyError):
        run_cli(capsys, "show", "0" * 16, "--store", root)
