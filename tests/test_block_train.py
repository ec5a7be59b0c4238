"""Block drafter training: a resumed run equals an uninterrupted one bit for bit, checkpoints are
verified on restore, bad data is refused, the loss falls, and a trained drafter stays exact."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from conftest import tiny_model
from specjax.atomic import CorruptFileError, read_json_checked
from specjax.decoding.sequences import GenerationConfig
from specjax.drafters.block import init_block_drafter
from specjax.drafters.block_train import Checkpoints, Corpus, TrainConfig, distill, train
from specjax.engine import Decoder
from specjax.errors import ConfigError

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")


@pytest.fixture(scope="module")
def setup():
    cfg, params = tiny_model(seed=4, scale=0.3)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, cfg.vocab_size, rng.integers(3, 9))) for _ in range(12)]
    corpus = distill(params, cfg, [[int(t) for t in p] for p in prompts], max_new_tokens=20, seed=1)
    drafter = init_block_drafter(params, cfg, jax.random.PRNGKey(3), 4, 1, [0, 1], conv=True)
    return cfg, params, corpus, drafter


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_resume_after_kill_equals_uninterrupted(setup, tmp_path):
    cfg, params, corpus, drafter = setup
    tcfg = TrainConfig(steps=6, batch=4, anchors=3, checkpoint_every=100, seed=5)
    whole, losses = train(drafter, params, cfg, corpus, tcfg, tmp_path / "a")
    part, first = train(drafter, params, cfg, corpus, tcfg, tmp_path / "b", stop_after=3)  # "killed"
    assert len(first) == 3 and Checkpoints(tmp_path / "b").latest() == 3
    resumed, rest = train(drafter, params, cfg, corpus, tcfg, tmp_path / "b")
    assert len(rest) == 3 and first + rest == losses
    for a, b in zip(leaves(whole.params), leaves(resumed.params)):
        np.testing.assert_array_equal(a, b)
    # a time budget ends the run after the step that passes it, checkpointed, and resumes the same
    _, timed = train(drafter, params, cfg, corpus, tcfg, tmp_path / "c", deadline=time.monotonic())
    assert len(timed) == 1 and Checkpoints(tmp_path / "c").latest() == 1
    again, rest = train(drafter, params, cfg, corpus, tcfg, tmp_path / "c")
    assert timed + rest == losses


def test_damaged_checkpoint_is_refused(setup, tmp_path):
    cfg, params, corpus, drafter = setup
    tcfg = TrainConfig(steps=2, batch=2, anchors=2)
    train(drafter, params, cfg, corpus, tcfg, tmp_path)
    manifest = tmp_path / "manifest-2.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"step": 2', '"step": 3'))
    with pytest.raises(CorruptFileError, match="checksum"):
        train(drafter, params, cfg, corpus, TrainConfig(steps=4, batch=2, anchors=2), tmp_path)
    manifest.write_text(text)
    files = sorted((f for f in (tmp_path / "state" / "2").rglob("*") if f.is_file()),
                   key=lambda f: f.stat().st_size)
    files[-1].write_bytes(files[-1].read_bytes()[: files[-1].stat().st_size // 2])  # truncated data
    with pytest.raises(CorruptFileError, match="unreadable|checksum"):
        train(drafter, params, cfg, corpus, TrainConfig(steps=4, batch=2, anchors=2), tmp_path)


def test_training_lowers_the_loss_and_stays_exact(setup, tmp_path):
    cfg, params, corpus, drafter = setup
    tcfg = TrainConfig(steps=60, batch=8, anchors=4, learning_rate=3e-3, warmup=5, checkpoint_every=1000)
    trained, losses = train(drafter, params, cfg, corpus, tcfg, tmp_path)
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])
    gen = GenerationConfig(max_new_tokens=16)
    prompts = [[1, 2, 3], [7, 7, 1, 0, 4]]
    ref = Decoder(cfg, params, gen).generate(prompts)
    out = Decoder(cfg, params, gen, trained).generate(prompts)
    if all(min(m, default=np.inf) >= 1e-3 for m in ref.margins):
        assert out.tokens == ref.tokens


def test_too_short_data_is_refused(setup, tmp_path):
    cfg, params, _, drafter = setup
    short = Corpus(np.zeros((2, 4), np.int32), np.array([4, 3], np.int32), np.array([3, 3], np.int32))
    with pytest.raises(ConfigError, match="continuation tokens"):
        train(drafter, params, cfg, short, TrainConfig(steps=1), tmp_path)


def test_cli_trains_smollm2_drafter_and_generate_uses_it(tmp_path, capsys):
    """`specjax train-drafter` on real prompts (HumanEval + ShareGPT, held-out split), then
    `generate --drafter block:DIR` gives AR's tokens; a wrong --k or another target is refused."""
    from specjax.cli import main
    from specjax.drafters.block_train import load_block_drafter
    out = tmp_path / "drafter"
    assert main(["train-drafter", "--out", str(out), "--steps", "2", "--batch", "2", "--anchors", "2",
                 "--prompts", "4", "--held-out", "1", "--max-new-tokens", "8", "--block-size", "4",
                 "--compare", "ngram"]) == 0
    text = capsys.readouterr().out
    assert "block humaneval" in text and "block sharegpt" in text and "ngram sharegpt" in text
    held = read_json_checked(out / "held_out.json")
    assert set(held["tau_by_drafter"]) == {"block", "ngram"} and held["k"] == 3
    assert all(t >= 1.0 for per in held["tau_by_drafter"].values() for t in per.values())
    from specjax.drafters.replay import load_profile
    assert len(load_profile(out / "profile.json")) == 3
    assert main(["generate", "--drafter", f"block:{out}", "--k", "3", "--humaneval", "1",
                 "--max-new-tokens", "12", "--compare-ar"]) == 0
    assert "tokens identical to AR" in capsys.readouterr().out
    exported = out / "drafter.safetensors"
    assert exported.is_file() and exported.stat().st_size < 20e6
    assert main(["generate", "--drafter", f"block:{exported}", "--k", "3", "--humaneval", "1",
                 "--max-new-tokens", "12", "--compare-ar"]) == 0
    assert "tokens identical to AR" in capsys.readouterr().out
    assert main(["generate", "--drafter", f"block:{out}", "--k", "5", "--prompt", "hi",
                 "--max-new-tokens", "2"]) == 2
    assert "--k must be 3" in capsys.readouterr().err
    cfg, params = tiny_model(seed=1)
    with pytest.raises(ConfigError, match="another target"):
        load_block_drafter(out, params, cfg)
    with pytest.raises(ConfigError, match="no block-drafter checkpoint"):
        load_block_drafter(tmp_path / "empty", params, cfg)


def test_cli_chat_prompts_file_must_hold_enough(tmp_path, capsys):
    from specjax.cli import main
    chat = tmp_path / "chat.jsonl"
    chat.write_text('"hello there"\n{"prompt": "write a haiku"}\n')
    assert main(["train-drafter", "--out", str(tmp_path / "d"), "--prompts", "8", "--held-out", "1",
                 "--chat-prompts", str(chat)]) == 2
    assert "chat.jsonl: 2 prompts, need 5" in capsys.readouterr().err


def test_export_round_trip_and_damage(setup, tmp_path):
    import jax.numpy as jnp

    from specjax.drafters.block_train import export_block_drafter, load_block_drafter
    cfg, params, _, drafter = setup
    path = tmp_path / "d.safetensors"
    export_block_drafter(drafter, path, cfg)
    back = load_block_drafter(path, params, cfg)
    assert (back.taps, back.block_size, back.k) == (drafter.taps, drafter.block_size, drafter.k)
    for a, b in zip(leaves(drafter.params), leaves(back.params)):  # bf16-rounded copies
        np.testing.assert_array_equal(np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32),
                                      np.asarray(b, np.float32))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match="checksum"):
        load_block_drafter(path, params, cfg)
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CorruptFileError):
        load_block_drafter(path, params, cfg)
    with pytest.raises(ConfigError, match="not found"):
        load_block_drafter(tmp_path / "missing.safetensors", params, cfg)


def test_shipped_smollm2_drafter_is_exact(capsys):
    """The trained block drafter that ships with specjax (`--drafter block`, block 8) on SmolLM2:
    token-identical to AR, and its recorded profiles load for acceptance replay."""
    from specjax.cli import main
    from specjax.drafters import trained
    from specjax.drafters.replay import load_profile
    assert "smollm2-135m-block8" in trained.available()
    assert main(["generate", "--drafter", "block", "--humaneval", "2", "--max-new-tokens", "24",
                 "--compare-ar"]) == 0
    out = capsys.readouterr().out
    assert out.count("tokens identical to AR") == 2
    assert len(load_profile(trained.profile_path("smollm2-135m-block8"))) == 7
    assert len(load_profile(trained.profile_path("smollm2-135m-block16"))) == 15
