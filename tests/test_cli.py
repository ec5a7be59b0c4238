"""`specjax generate`: a run end to end on a tiny checkpoint, and one clear line + exit code 2 for each
kind of bad input (no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import save_tiny_checkpoint
from specjax.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def run(capsys, *argv):
    capsys.readouterr()  # drop what fixtures printed (transformers' progress bars)
    code = main(["generate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_user_error(capsys, argv, *needles):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("specjax: error:") and "Traceback" not in err and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def test_generate_runs_and_matches_ar(capsys, tiny_dir):
    code, out, _ = run(capsys, "--model", str(tiny_dir), "--prompt", "abc abc abc", "--drafter", "ngram",
                       "--k", "3", "--max-new-tokens", "12", "--compare-ar")
    assert code == 0
    assert "[stats] tokens=" in out and "tau=" in out and "tokens identical to AR" in out


def test_missing_model(capsys, tmp_path):
    assert_user_error(capsys, ["--model", str(tmp_path / "nope"), "--prompt", "x"], str(tmp_path / "nope"))


def test_unreadable_config(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert_user_error(capsys, ["--model", str(tmp_path), "--prompt", "x"], "config.json", "unreadable")


def test_unsupported_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert_user_error(capsys, ["--model", str(tmp_path), "--prompt", "x"], "unsupported architecture",
                      "GPT2LMHeadModel")


def test_missing_weights(capsys, tmp_path, tiny_dir):
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    assert_user_error(capsys, ["--model", str(tmp_path), "--prompt", "x"], "no model.safetensors")


def test_unsupported_gguf_tensor_type(capsys, tmp_path):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    for add, v in [(w.add_block_count, 1), (w.add_embedding_length, 32), (w.add_feed_forward_length, 64),
                   (w.add_head_count, 2), (w.add_head_count_kv, 2), (w.add_layer_norm_rms_eps, 1e-5)]:
        add(v)
    w.add_tensor("token_embd.weight", np.zeros((10, 32), np.float32))
    # Q8_1 (40 bytes per block of 32 weights): a type gguf-py cannot dequantize
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 40), np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert_user_error(capsys, ["--model", str(tmp_path / "q.gguf"), "--prompt", "x"],
                      "blk.0.attn_q.weight", "unsupported GGUF type Q8_1")


def test_vocabulary_mismatch(capsys, tmp_path, tiny_dir):
    other = save_tiny_checkpoint(tmp_path, vocab_size=30)
    assert_user_error(capsys, ["--model", str(tiny_dir), "--drafter", str(other), "--prompt", "abc"],
                      "vocabulary size 30", "target's 40")


def test_prompt_longer_than_context(capsys, tmp_path):
    short = save_tiny_checkpoint(tmp_path, max_positions=24)
    assert_user_error(capsys, ["--model", str(short), "--prompt", "abcdefghij" * 3, "--max-new-tokens", "4"],
                      "prompt 0 has 30 tokens", "context of 24")


@pytest.mark.parametrize("k", ["0", "-2"])
def test_k_below_one(capsys, tiny_dir, k):
    assert_user_error(capsys, ["--model", str(tiny_dir), "--prompt", "abc", "--k", k], "--k must be >= 1", k)


def test_bad_layerskip_depth(capsys, tiny_dir):
    assert_user_error(capsys, ["--model", str(tiny_dir), "--prompt", "abc", "--drafter", "layerskip:9"],
                      "layerskip:K needs 1 <= K <= 2", "9")


def test_prompts_file_errors(capsys, tmp_path, tiny_dir):
    assert_user_error(capsys, ["--model", str(tiny_dir), "--prompts-file", str(tmp_path / "none.jsonl")],
                      "none.jsonl", "not found")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"abc"\n{"prompt": 3}\n')
    assert_user_error(capsys, ["--model", str(tiny_dir), "--prompts-file", str(bad)], "bad.jsonl:2")


def test_bad_sampling_values(capsys, tiny_dir):
    assert_user_error(capsys, ["--model", str(tiny_dir), "--prompt", "a", "--top-p", "0"], "top_p")
    assert_user_error(capsys, ["--model", str(tiny_dir), "--prompt", "a", "--temperature", "-1"], "temperature")


def test_process_exit_code(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "specjax.cli", "generate", "--model", str(tmp_path / "x"),
                           "--prompt", "hi"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "specjax: error:" in proc.stderr


def test_tensor_parallel_needs_the_devices(capsys, tiny_dir):
    import jax
    n = jax.device_count() + 1
    assert_user_error(capsys, ["--model", str(tiny_dir), "--prompt", "abc", "--tp", str(n)],
                      f"tensor parallelism over {n} devices: {n - 1} available")
