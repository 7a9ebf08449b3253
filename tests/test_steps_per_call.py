"""train.steps_per_call: several steps in one compiled call train as the single steps do (the
same losses, the same resume), compile once, and stop at log, evaluation and checkpoint
steps."""

import numpy as np
import pytest

from model.rundir.checkpoints import Checkpoints
from model.train_stage import run_train
from model.training.config import TrainConfig
from model.training.metrics import read_metrics
from model.training.trainer import Trainer
from tests.tiny_runs import TINY_TRAIN, tiny_run_config, write_word_corpus
from tokenizer.stage import run_tokenize

# Logs every 4 steps, evaluates and saves every 8, stops at 10: calls of 4 steps, then 2
# single steps after step 8.
EVERY_4 = [
    *TINY_TRAIN,
    "train.log_interval=4",
    "train.eval_interval=8",
    "train.lr_decay_steps=10",
]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus") / "tiny.txt", 400)


def trained(run_dir, corpus_file, *extra, resume=False):
    cfg = tiny_run_config(corpus_file, EVERY_4, *extra)
    if not resume:
        run_tokenize(cfg, run_dir)
    run_train(cfg, run_dir, resume=resume)
    records = read_metrics(run_dir)
    losses = {r["step"]: [r["train_loss"]] for r in records if "train_loss" in r}
    for r in records:
        if "val_loss" in r:
            losses[r["step"]].append(r["val_loss"])
    return losses


def test_calls_stop_where_the_loop_acts():
    t = TrainConfig(max_steps=10, log_interval=4, eval_interval=8, steps_per_call=4)
    assert [t.steps_in_call(s) for s in (0, 4, 8, 9)] == [4, 4, 1, 1]
    t = TrainConfig(batch_size=8, batch_size_schedule=[[0, 4], [6, 8]], steps_per_call=4)
    assert [t.steps_in_call(s) for s in (0, 4, 5, 6)] == [4, 1, 1, 4]


def test_calls_of_four_steps_give_the_single_steps_losses_and_resume(tmp_path, corpus_file, capsys):
    single = trained(tmp_path / "single", corpus_file, "train.max_steps=10")
    calls = trained(tmp_path / "calls", corpus_file, "train.max_steps=10", "train.steps_per_call=4")
    assert ", 4 steps a call" in capsys.readouterr().err
    assert sorted(calls) == sorted(single) == [4, 8, 10]
    for step in single:
        np.testing.assert_allclose(calls[step], single[step], rtol=1e-5, atol=1e-6)

    # Stopped at step 8 (its checkpoint), resumed to 10: the uninterrupted run's losses.
    half = tmp_path / "half"
    four = "train.steps_per_call=4"
    trained(half, corpus_file, "train.max_steps=8", four)
    assert Checkpoints(half).latest_step() == 8
    resumed = trained(half, corpus_file, "train.max_steps=10", four, resume=True)
    np.testing.assert_allclose(resumed[10], calls[10], rtol=1e-5, atol=1e-6)


def test_calls_longer_than_the_log_interval_are_single_steps_and_said_so(
    tmp_path, corpus_file, capsys
):
    logged = trained(tmp_path / "run", corpus_file, "train.max_steps=4", "train.steps_per_call=8")
    assert sorted(logged) == [4]
    assert "one step a call (train.steps_per_call = 8 would pass" in capsys.readouterr().err


def test_a_call_of_several_steps_compiles_once_and_matches_them(corpus_file):
    cfg = tiny_run_config(corpus_file, TINY_TRAIN)
    tokens = (np.arange(3000) * 7 % 40).astype(np.uint16)
    singles = Trainer(cfg.train, cfg.model.for_vocab(40))
    calls = Trainer(cfg.train, cfg.model.for_vocab(40))
    a, b = singles.initial_state(), calls.initial_state()
    for step in range(0, 9, 3):
        for s in range(step, step + 3):
            a, last = singles.train_step(a, *singles.batch(tokens, s))
        b, metrics = calls.train_steps(b, *calls.batches(tokens, step, 3))
        np.testing.assert_allclose(float(metrics["loss"]), float(last["loss"]), rtol=1e-5)
    assert a.steps_taken() == b.steps_taken() == 9
    assert calls.train_steps._cache_size() == 1
    for p, q in zip(*(jax_leaves(s.params) for s in (a, b)), strict=True):
        np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
