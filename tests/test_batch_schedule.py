"""train.batch_size_schedule: each step's batch has the schedule's size (split into grad_accum
micro-batches), each size compiles once, a resumed run replays the uninterrupted one across a
size change, 4 devices train as 1, and a size the devices cannot split is refused."""

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from configs.schema import load_config, resolve_config_path
from model.train_stage import run_train
from model.training.config import TrainConfig
from model.training.data import sample_batch
from model.training.metrics import read_metrics
from model.training.trainer import Trainer
from plumbing.errors import UsageError
from tests.child_env import child_env
from tests.tiny_models import TINY
from tests.tiny_runs import TINY_TRAIN, tiny_run_config, write_word_corpus
from tokenizer.stage import run_tokenize

ROOT = Path(__file__).resolve().parents[1]
TOKENS = (np.arange(4000) * 7 % 64).astype(np.uint16)


def test_the_schedule_gives_each_steps_size_and_refuses_what_cannot_run():
    t = TrainConfig(batch_size=8, batch_size_schedule=[[0, 2], [3, 4], [5, 8]]).validate()
    assert [t.batch_size_at(s) for s in range(7)] == [2, 2, 2, 4, 4, 8, 8]
    assert [t.sequences_before(s) for s in (0, 3, 5, 7)] == [0, 6, 14, 30]
    assert t.batch_sizes == [2, 4, 8] and t.shared_rows == 2
    plain = TrainConfig(batch_size=8).validate()  # off: batch_size throughout
    assert plain.batch_size_at(100) == 8 and plain.sequences_before(3) == 24
    bad = {
        "[[1, 4], [6, 8]]": "steps must start at 0 and rise",
        "[[0, 4], [0, 8]]": "steps must start at 0 and rise",
        "[[0, 4]]": r"must end at train.batch_size \(8\)",
        "[[0, 4], [6, 16]]": "must be at most train.batch_size",
        "[[0, 3], [6, 8]]": r"divisible by train.grad_accum \(2\)",
        "[[0, 4, 1]]": r"must be \[\[from_step, batch_size\], ...\]",
    }
    for schedule, message in bad.items():
        with pytest.raises(UsageError, match=message):
            overrides = ["train.batch_size=8", "train.grad_accum=2"]
            overrides.append(f"train.batch_size_schedule={schedule}")
            load_config(resolve_config_path("shakespeare_char"), overrides)
    with pytest.raises(UsageError, match="must divide"):  # CPU devices split every size
        TrainConfig(batch_size=8, batch_size_schedule=[[0, 2], [4, 8]], cpu_devices=4).validate()


def test_batches_follow_the_schedule_and_each_size_compiles_once():
    cfg = TrainConfig(batch_size=8, grad_accum=2, warmup_steps=1,
                      batch_size_schedule=[[0, 2], [3, 4], [5, 8]]).validate()  # fmt: skip
    trainer = Trainer(cfg, TINY)
    state = trainer.initial_state()
    for step in range(7):
        x, y = trainer.batch(TOKENS, step)
        rows = cfg.batch_size_at(step)
        assert x.shape == (2, rows // 2, TINY.block_size)  # [grad_accum, micro-batch, T]
        expected, _ = sample_batch(TOKENS, rows, TINY.block_size, cfg.seed, step)
        np.testing.assert_array_equal(np.asarray(x).reshape(rows, -1), expected)
        state, metrics = trainer.train_step(state, x, y)
        assert np.isfinite(float(metrics["loss"]))
    assert state.steps_taken() == 7
    assert trainer.train_step._cache_size() == 3  # one program per batch size


def test_a_size_the_devices_cannot_split_is_refused(monkeypatch):
    four = types.SimpleNamespace(devices=np.zeros(4))
    monkeypatch.setattr("model.training.trainer.data_mesh", lambda: four)
    cfg = TrainConfig(batch_size=8, batch_size_schedule=[[0, 2], [4, 8]]).validate()
    with pytest.raises(UsageError, match=r"schedule's micro-batch \(2 / .* over the 4 devices"):
        Trainer(cfg, TINY)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus") / "tiny.txt", 400)


def tokenized_run(run_dir, corpus_file, *extra):
    cfg = tiny_run_config(corpus_file, TINY_TRAIN, "train.lr_decay_steps=8", *extra)
    run_tokenize(cfg, run_dir)
    return cfg


def test_resume_replays_the_uninterrupted_run_across_a_size_change(tmp_path, corpus_file):
    """Batches of 2 then 4 (from step 6) in 2 micro-batches: 8 steps straight, or 4 and a
    resume across the change, give the same losses; the log names each step's batch."""
    schedule = ("train.batch_size_schedule=[[0, 2], [6, 4]]", "train.grad_accum=2")
    straight, resumed = tmp_path / "a", tmp_path / "b"
    run_train(tokenized_run(straight, corpus_file, "train.max_steps=8", *schedule), straight)
    run_train(tokenized_run(resumed, corpus_file, "train.max_steps=4", *schedule), resumed)
    more = tiny_run_config(corpus_file, TINY_TRAIN, "train.lr_decay_steps=8", "train.max_steps=8",
                           *schedule)  # fmt: skip
    run_train(more, resumed, resume=True)
    a, b = (
        {r["step"]: r for r in read_metrics(run) if "train_loss" in r}
        for run in (straight, resumed)
    )
    assert sorted(a) == sorted(b) == list(range(1, 9))
    np.testing.assert_allclose(
        [b[s]["train_loss"] for s in a], [a[s]["train_loss"] for s in a], rtol=1e-5, atol=1e-6
    )
    assert [a[s]["batch_size"] for s in a] == [2] * 6 + [4] * 2
    assert [b[s]["tokens"] for s in a] == [a[s]["tokens"] for s in a]
    assert a[8]["tokens"] == (6 * 2 + 2 * 4) * 16 and all(a[s]["tokens_per_sec"] > 0 for s in a)


def test_four_simulated_devices_match_one_through_the_schedule(tmp_path, corpus_file):
    """Data parallel and FSDP on 4 devices give the 1-device losses through a size change;
    the step compiles once per size, and once after a restore (one size left)."""
    from tests.multidevice_run import short_run

    overrides = [
        f"data.input={json.dumps([str(corpus_file)])}", *TINY_TRAIN, "train.lr_decay_steps=8",
        "train.batch_size=8", "train.batch_size_schedule=[[0, 4], [3, 8]]",
    ]  # fmt: skip
    config = str(ROOT / "configs" / "shakespeare_char.toml")
    run_dir = tmp_path / "run"
    tokenized_run(run_dir, corpus_file)
    one = short_run(config, str(run_dir), overrides)
    env = child_env(devices=4)
    script = str(ROOT / "tests" / "multidevice_run.py")
    proc = subprocess.run(
        [sys.executable, script, config, str(run_dir), json.dumps(overrides)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    four = json.loads(proc.stdout.strip().splitlines()[-1])
    assert four["devices"] == 4 and four["batch_shard_rows"] == [1, 1, 1, 1]  # step 0: 4 rows
    for mode in ("data_parallel", "fsdp"):
        np.testing.assert_allclose(four[mode], one["data_parallel"], rtol=2e-5, atol=2e-5)
    assert four["fsdp_step_compiles"] == 2 and four["resumed_step_compiles"] == 1
    np.testing.assert_allclose(four["resumed"], four["continued"], rtol=1e-6, atol=1e-6)
