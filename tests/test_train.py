"""The --train stage on tiny models: resume replays exactly, one compilation, sharded batches,
NaN stops without damaging checkpoints, the token cache follows its inputs (training's parts
alone: test_train_parts.py)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from model.rundir.checkpoints import Checkpoints
from model.train_stage import run_train
from model.training.errors import TrainingDiverged
from model.training.metrics import read_metrics
from model.training.trainer import Trainer
from plumbing.errors import UsageError
from tests.child_env import child_env
from tests.tiny_runs import RECIPE, TINY_TRAIN, tiny_run_config, write_word_corpus
from tokenizer import load_tokenizer
from tokenizer.stage import run_tokenize

ROOT = Path(__file__).resolve().parents[1]
TINY = [*TINY_TRAIN, "train.lr_decay_steps=8"]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus") / "tiny.txt", 400)


def tiny_config(corpus_file, *extra):
    return tiny_run_config(corpus_file, TINY, *extra)


def tokenized_run(tmp_path, corpus_file, *extra):
    cfg = tiny_config(corpus_file, *extra)
    run_dir = tmp_path / "run"
    run_tokenize(cfg, run_dir)
    return cfg, run_dir


def train_losses(run_dir):
    return {r["step"]: r["train_loss"] for r in read_metrics(run_dir) if "train_loss" in r}


@pytest.mark.parametrize("recipe", [[], RECIPE], ids=["gpt2-recipe", "modern-recipe"])
def test_resume_replays_the_uninterrupted_run(tmp_path, corpus_file, recipe, capsys):
    cfg, straight = tokenized_run(tmp_path / "a", corpus_file, "train.max_steps=8", *recipe)
    run_train(cfg, straight)
    assert "train: done, 8 steps in" in capsys.readouterr().err

    half_cfg, resumed = tokenized_run(tmp_path / "b", corpus_file, "train.max_steps=4", *recipe)
    run_train(half_cfg, resumed)
    assert Checkpoints(resumed).latest_step() == 4
    capsys.readouterr()
    run_train(tiny_config(corpus_file, "train.max_steps=8", *recipe), resumed, resume=True)
    err = capsys.readouterr().err
    assert "train: done, steps 5-8 in" in err  # this call's, not 8
    assert "learning rate now decays" not in err  # train.lr_decay_steps=8 kept it

    a, b = train_losses(straight), train_losses(resumed)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    np.testing.assert_allclose([b[s] for s in a], list(a.values()), rtol=1e-5, atol=1e-6)
    val_a = [r["val_loss"] for r in read_metrics(straight) if "val_loss" in r]
    val_b = [r["val_loss"] for r in read_metrics(resumed) if "val_loss" in r]
    np.testing.assert_allclose(val_b, val_a, rtol=1e-5)
    assert (straight / "loss.png").exists() and (straight / "config.json").exists()


def test_raising_max_steps_on_resume_says_the_schedule_changes(tmp_path, corpus_file, capsys):
    # with train.lr_decay_steps 0 the decay stretched to the new max_steps without a word
    cfg, run_dir = tokenized_run(
        tmp_path, corpus_file, "train.max_steps=4", "train.lr_decay_steps=0"
    )
    run_train(cfg, run_dir)
    capsys.readouterr()
    longer = tiny_config(corpus_file, "train.max_steps=6", "train.lr_decay_steps=0")
    run_train(longer, run_dir, resume=True)
    err = capsys.readouterr().err
    assert "resume: the learning rate now decays over 6 steps, not the run's 4" in err
    assert "train.lr_decay_steps=4" in err


def test_config_json_records_the_tokenizer_the_run_trained_with(tmp_path, corpus_file, capsys):
    # --train with a config naming bpe 500 trained on the run's char tokenizer without a word,
    # and config.json (which --plan and --resume read back) said bpe 500
    _, run_dir = tokenized_run(tmp_path, corpus_file, "train.max_steps=2")
    chars = load_tokenizer(run_dir / "tokenizer.pkl")
    other = tiny_config(
        corpus_file, "train.max_steps=2", "tokenizer.kind=bpe", "tokenizer.vocab_size=500"
    )
    run_train(other, run_dir)
    assert "train: on the run's char tokenizer" in capsys.readouterr().err
    saved = json.loads((run_dir / "config.json").read_text())["tokenizer"]
    assert saved["kind"] == "char" and saved["vocab_size"] == chars.vocab_size


def test_outputs_and_metrics_fields(tmp_path, corpus_file, monkeypatch, capsys):
    # train.deterministic: XLA's flag is set before JAX's backend would read it (a no-op on CPU).
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    cfg, run_dir = tokenized_run(
        tmp_path, corpus_file, "train.max_steps=4", "train.deterministic=true"
    )
    record = run_train(cfg, run_dir)
    assert "--xla_gpu_deterministic_ops=true" in os.environ["XLA_FLAGS"].split()
    assert "deterministic GPU kernels" in capsys.readouterr().err
    assert record["val_bpb"] > 0 and np.isfinite(record["val_loss"])
    first = read_metrics(run_dir)[0]
    assert {"step", "train_loss", "tokens_per_sec", "elapsed_s"} <= set(first)
    evals = [r for r in read_metrics(run_dir) if "val_loss" in r]
    assert evals[-1]["step"] == 4 and "val_bpb" in evals[-1]


def test_tokens_per_sec_leaves_out_compiling_and_saving(tmp_path, corpus_file, monkeypatch):
    # The first logged window held the first step's compile: its figure was a fraction of
    # the others. A checkpoint inside a window slowed that window's figure too. Both are
    # made 1.5 s longer here, so that a window that counted either would take over 1.5 s,
    # while the steps of this tiny model take well under 1 s however loaded the machine.
    import jax

    import model.training.loop as loop_module

    real_wait, real_save = jax.block_until_ready, Checkpoints.save
    first = []

    def slow_first_wait(x):  # the loop waits for the first step (its compile) alone
        if not first:
            time.sleep(1.5)
            first.append(True)
        return real_wait(x)

    def slow_save(self, *args, **kwargs):
        time.sleep(1.5)
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(loop_module.jax, "block_until_ready", slow_first_wait)
    monkeypatch.setattr(Checkpoints, "save", slow_save)
    cfg, run_dir = tokenized_run(
        tmp_path, corpus_file, "train.max_steps=12", "train.log_interval=4",
        "train.eval_interval=12", "train.checkpoint_interval=2", "train.steps_per_call=1",
    )  # fmt: skip
    run_train(cfg, run_dir)
    assert first  # the first step was waited for, and slowed
    rates = [r["tokens_per_sec"] for r in read_metrics(run_dir) if "tokens_per_sec" in r]
    assert len(rates) == 3
    tokens = 4 * cfg.train.batch_size * cfg.model.block_size  # at most, a window of 4 steps
    assert all(tokens / rate < 1.0 for rate in rates), rates


def test_train_step_compiles_once(tmp_path, corpus_file):
    cfg, run_dir = tokenized_run(tmp_path, corpus_file, "train.grad_accum=2")
    from model.training.data import load_token_splits
    from tokenizer import load_tokenizer
    from tokenizer.corpus import corpus_for

    tok = load_tokenizer(run_dir / "tokenizer.pkl")
    splits = load_token_splits(corpus_for(cfg.data), tok, run_dir / "tokenizer.pkl", run_dir, 0.1)
    trainer = Trainer(cfg.train, cfg.model.for_vocab(tok.vocab_size))
    state = trainer.initial_state()
    for step in range(5):
        x, y = trainer.batch(splits.train, step)
        state, metrics = trainer.train_step(state, x, y)
    assert float(metrics["loss"]) > 0 and state.steps_taken() == 5
    assert trainer.train_step._cache_size() == 1


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority is Linux's")
def test_matplotlib_is_imported_on_a_thread_of_the_lowest_priority(monkeypatch):
    """The import runs while the devices use every core: at nice 19 it takes only their idle
    moments."""
    from model.training import metrics

    calls = []
    monkeypatch.setattr(os, "setpriority", lambda *args: calls.append(args))
    thread = metrics.import_plotting_soon()
    thread.join()
    assert calls == [(os.PRIO_PROCESS, thread.native_id, 19)]
    assert "matplotlib.pyplot" in sys.modules


def test_orbax_is_imported_at_the_first_save_or_on_the_training_loops_thread(tmp_path):
    """A run's start-up does not wait for orbax: making, waiting on and closing Checkpoints
    import nothing; the first save does (and a loop imports it aside before then)."""
    script = f"""
import sys
from pathlib import Path
import numpy as np
from model.rundir.checkpoints import Checkpoints, import_soon
run = Path({str(tmp_path)!r})
ckpt = Checkpoints(run)
ckpt.remove_leftovers(); ckpt.wait(); ckpt.close()
print("orbax.checkpoint" in sys.modules, ckpt.steps())
ckpt = Checkpoints(run)
ckpt.save(3, {{"w": np.ones(4, np.float32)}}, None, {{"config": {{}}}})
ckpt.close()
print("orbax.checkpoint" in sys.modules, Checkpoints(run, read_only=True).steps())
import_soon().join()
"""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[:2] == ["False []", "True [3]"]
    script = "import sys\nfrom model.rundir.checkpoints import import_soon\n"
    script += "import_soon().join()\nprint('orbax.checkpoint' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "True"


def test_the_state_reaches_jax_flat_and_reads_back_as_nested_trees():
    """Each call of the step flattens the state: one node over its arrays, not a Flax
    Variable each (their flattening in Python was most of the step's dispatch); the params
    and the optimizer state still read back as the trees they were, with their paths."""
    import jax
    from flax import nnx

    from model.network.config import ModelConfig
    from model.training.config import TrainConfig

    cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    trainer = Trainer(TrainConfig(batch_size=4, optimizer="muon"), cfg)
    state = trainer.initial_state()
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert treedef.num_nodes == len(leaves) + 1  # the state, then its arrays
    assert not any(isinstance(x, nnx.Variable) for x in leaves)
    params_tree = jax.tree_util.tree_structure(trainer.param_shapes())
    x, y = trainer.batch(np.arange(200, dtype=np.uint16) % 64, step=0)
    state, _ = trainer.train_step(state, x, y)
    assert jax.tree_util.tree_structure(state.params) == params_tree
    assert isinstance(state.params, nnx.State) and state.steps_taken() == 1
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    assert paths[0].startswith(".params['") and paths[-2:] == [".step", ".key"]
    assert any(p.startswith(".opt_state[") for p in paths)


def test_nan_stops_and_keeps_last_good_checkpoint(tmp_path, corpus_file):
    cfg, run_dir = tokenized_run(tmp_path, corpus_file, "train.max_steps=4")
    run_train(cfg, run_dir)
    wild = tiny_config(corpus_file, "train.max_steps=8", "train.learning_rate=1e30")
    with pytest.raises(TrainingDiverged, match="last good checkpoint is kept"):
        run_train(wild, run_dir, resume=True)
    assert Checkpoints(run_dir).latest_step() == 4


def test_a_checkpoint_step_that_is_not_logged_is_checked_before_it_is_saved(tmp_path, corpus_file):
    # checkpoints every 2 steps, logs and evaluates every 4: step 2's NaN weights were saved,
    # then sampled from and resumed
    _, run_dir = tokenized_run(tmp_path, corpus_file)
    wild = tiny_config(
        corpus_file, "train.learning_rate=1e30", "train.warmup_steps=0", "train.max_steps=8",
        "train.checkpoint_interval=2", "train.log_interval=4", "train.eval_interval=4",
    )  # fmt: skip
    with pytest.raises(TrainingDiverged, match="at step 2: training stopped"):
        run_train(wild, run_dir)
    assert Checkpoints(run_dir).latest_step() is None


def test_a_diverged_auxiliary_metric_is_named():
    from model.training.loop import check_finite

    with pytest.raises(TrainingDiverged, match=r"^mtp_loss \(the loss is 4\.06\) became inf"):
        check_finite(8, {"loss": 4.06, "mtp_loss": float("inf")})
    with pytest.raises(TrainingDiverged, match=r"^the loss became nan at step 3"):
        check_finite(3, {"loss": float("nan"), "grad_norm": float("inf")})


def test_train_without_tokenizer_is_a_usage_error(tmp_path, corpus_file):
    with pytest.raises(UsageError, match="no tokenizer in"):
        run_train(tiny_config(corpus_file), tmp_path / "empty")
    assert not (tmp_path / "empty").exists()


def test_resume_with_a_different_model_is_refused(tmp_path, corpus_file):
    cfg, run_dir = tokenized_run(tmp_path, corpus_file, "train.max_steps=2")
    run_train(cfg, run_dir)
    with pytest.raises(UsageError, match=r"model\.n_layer is 1 in the checkpoint but 2 now"):
        run_train(tiny_config(corpus_file, "train.max_steps=4", "model.n_layer=2"), run_dir, True)
    with pytest.raises(UsageError, match="block_size 32 is above the trained model's 16"):
        run_train(
            tiny_config(corpus_file, "train.max_steps=4", "model.block_size=32"), run_dir, True
        )
    with pytest.raises(UsageError, match="already holds a trained model"):
        run_train(cfg, run_dir)


def test_token_cache_is_rebuilt_when_the_corpus_changes(tmp_path, corpus_file):
    from model.training.data import load_token_splits
    from tokenizer import load_tokenizer
    from tokenizer.corpus import file_corpus

    _, run_dir = tokenized_run(tmp_path, corpus_file)
    tok_path = run_dir / "tokenizer.pkl"
    tok = load_tokenizer(tok_path)
    text = tmp_path / "copy.txt"
    text.write_text(corpus_file.read_text())
    first = load_token_splits(file_corpus([text]), tok, tok_path, run_dir, 0.1)
    assert first.train.dtype == np.uint16
    with open(text, "a") as f:
        f.write("to be\n" * 200)
    second = load_token_splits(file_corpus([text]), tok, tok_path, run_dir, 0.1)
    assert len(second.train) + len(second.val) == len(first.train) + len(first.val) + 1200
    assert second.val_bytes == len(second.val)  # character tokens of ASCII text: 1 byte each


@pytest.mark.parametrize("recipe", [[], RECIPE], ids=["gpt2-recipe", "modern-recipe"])
def test_four_simulated_devices_match_one(tmp_path, corpus_file, recipe):
    """Same global batch on 1 and 4 devices (data parallel and FSDP): the same losses; FSDP
    shards the optimizer state and compiles the step once, fresh and resumed."""
    from tests.multidevice_run import short_run

    overrides = [f"data.input={json.dumps([str(corpus_file)])}", *TINY, *recipe]
    config = str(ROOT / "configs" / "shakespeare_char.toml")
    _, run_dir = tokenized_run(tmp_path, corpus_file)
    one = short_run(config, str(run_dir), overrides)
    env = child_env(devices=4)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "multidevice_run.py"),
            config,
            str(run_dir),
            json.dumps(overrides),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    four = json.loads(proc.stdout.strip().splitlines()[-1])
    assert one["devices"] == 1 and four["devices"] == 4
    # The batch really is split: 4 distinct shards of 1 row each (global batch 4).
    assert len(four["batch_shards"]) == 4 and four["batch_shard_rows"] == [1, 1, 1, 1]
    assert four["dp_param_shards"] == 1 and four["fsdp_param_shards"] == 4
    for mode in ("data_parallel", "fsdp"):
        np.testing.assert_allclose(four[mode], one["data_parallel"], rtol=2e-5, atol=2e-5)
    # FSDP shards what it says: every optimizer moment of 2+ dimensions is laid out as its
    # parameter (sharded), and JAX compiles the step once, fresh and after a restore.
    for run in ("fsdp", "resumed"):
        layout = four[f"{run}_optimizer"]
        assert layout["leaves"] > 0 and layout["alike"] == layout["sharded"] == layout["leaves"]
        assert four[f"{run}_step_compiles"] == 1, four
    np.testing.assert_allclose(four["resumed"], four["continued"], rtol=1e-6, atol=1e-6)


def test_trains_from_a_local_dataset_through_the_hf_loader(tmp_path, corpus_file):
    """--dataset goes through `datasets` (streaming); a local JSON-lines file stands in."""
    data = tmp_path / "stories.jsonl"
    lines = corpus_file.read_text().splitlines()
    data.write_text("".join(json.dumps({"story": line}) + "\n" for line in lines))
    cfg = tiny_config(corpus_file, "train.max_steps=2", "data.input=[]")
    cfg.data.dataset, cfg.data.text_field = str(data), "story"
    run_dir = tmp_path / "run"
    run_tokenize(cfg, run_dir)
    record = run_train(cfg, run_dir)
    assert np.isfinite(record["val_loss"])
    meta = json.loads((run_dir / "tokens" / "meta.json").read_text())
    assert meta["key"]["corpus"].startswith("dataset:")
    assert meta["n_chars"] == len("\n\n".join(lines))


def test_cli_trains_data_parallel_over_cpu_devices_with_the_same_losses(tmp_path, corpus_file):
    """--train exposes one CPU device per core (here 2, asked for explicitly so that the test
    does not depend on the machine) and gets the single-device losses."""
    env = child_env()
    losses = {}
    for devices in (1, 2):
        out = tmp_path / f"run{devices}"
        cmd = [
            sys.executable,
            str(ROOT / "tinyllm.py"),
            "--tokenize",
            "--train",
            "--config",
            str(ROOT / "configs" / "shakespeare_char.toml"),
            "--input",
            str(corpus_file),
            "--out",
            str(out),
            *TINY,
            "train.max_steps=8",
            f"train.cpu_devices={devices}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"{devices} x cpu" in proc.stderr
        losses[devices] = train_losses(out)
    assert sorted(losses[2]) == list(range(1, 9))
    np.testing.assert_allclose(
        [losses[2][s] for s in range(1, 9)], [losses[1][s] for s in range(1, 9)], rtol=2e-5
    )
