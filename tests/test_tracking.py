"""train.tracker: TensorBoard's reader and W&B's offline run hold metrics.jsonl's numbers at
every logged step, each step once across --resume (also after a crash past the last
checkpoint); a missing package or a bad value is refused in one line."""

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import tinyllm
from model.train_stage import run_train
from model.training.metrics import read_metrics
from model.training.tracking import open_tracker, require_tracker
from plumbing.errors import UsageError
from tests.tiny_runs import ROOT, TINY_TRAIN, tiny_run_config, write_word_corpus
from tokenizer.stage import run_tokenize

TINY = [*TINY_TRAIN, "train.lr_decay_steps=8"]  # evaluated and saved at steps 4 and 8
CHAR_CONFIG = ROOT / "configs" / "shakespeare_char.toml"


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    return write_word_corpus(tmp_path_factory.mktemp("corpus") / "tiny.txt", 400)


def tiny_config(corpus_file, *extra):
    return tiny_run_config(corpus_file, TINY, *extra)


def jsonl_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """name -> {step: value} from metrics.jsonl, the first value a step gave each name (a
    step's eval record repeats elapsed_s)."""
    out: dict[str, dict[int, float]] = {}
    for record in read_metrics(run_dir):
        for name, value in record.items():
            if name != "step" and isinstance(value, int | float):
                out.setdefault(name, {}).setdefault(record["step"], value)
    return out


def tensorboard_scalars(run_dir: Path, reader: str) -> dict[str, list[tuple[int, float]]]:
    """name -> [(step, value)] as one of TensorBoard's Python readers shows RUN/tensorboard/:
    "scalars" (event_accumulator) or "tensors" (plugin_event_accumulator, what `tensorboard
    --load_fast=false` serves; it ignores the first restart marker it reads)."""
    from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
    from tensorboard.util.tensor_util import make_ndarray

    logdir = str(run_dir / "tensorboard")
    if reader == "scalars":
        acc = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0}).Reload()
        return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    acc = plugin_event_accumulator.EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    return {
        t: [(e.step, make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(t)]
        for t in acc.Tags()["tensors"]
    }


def raw_steps(run_dir: Path, tag: str) -> list[int]:
    """The steps of every `tag` event in the files, before the reader drops any."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for path in sorted((run_dir / "tensorboard").iterdir()):
        for event in EventFileLoader(str(path)).Load():
            steps += [event.step for v in event.summary.value if v.tag == tag]
    return steps


def assert_tensorboard_matches(run_dir: Path, last_step: int) -> None:
    expected = jsonl_scalars(run_dir)
    assert set(expected) >= {"train_loss", "val_loss", "val_bpb", "elapsed_s"}
    assert sorted(expected["train_loss"]) == list(range(1, last_step + 1))
    for reader in ("scalars", "tensors"):
        shown = tensorboard_scalars(run_dir, reader)
        assert set(shown) == set(expected), reader
        for name, points in shown.items():
            steps = [step for step, _ in points]  # each once, in order
            assert steps == sorted(expected[name]), f"{reader}, {name}: steps {steps}"
            want = [expected[name][step] for step in steps]
            got = [v for _, v in points]
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{reader}, {name}")


def test_tensorboard_curves_match_metrics_across_resume(tmp_path, corpus_file):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("tensorboard")
    cfg = tiny_config(corpus_file, "train.max_steps=8", "train.tracker=tensorboard")
    run_dir = tmp_path / "run"
    run_tokenize(cfg, run_dir)
    run_train(cfg, run_dir)
    assert_tensorboard_matches(run_dir, 8)

    # A crash after steps 5-8 were logged but before step 8's checkpoint was committed: the
    # resumed run logs them again, and the readers show only the new ones.
    shutil.rmtree(run_dir / "checkpoints" / "8")
    run_train(cfg, run_dir, resume=True)
    assert_tensorboard_matches(run_dir, 8)
    assert sorted(raw_steps(run_dir, "train_loss")) == [1, 2, 3, 4, *[5, 5, 6, 6, 7, 7, 8, 8]]

    # An ordinary resume: step 8, logged before it, is kept.
    longer = tiny_config(corpus_file, "train.max_steps=12", "train.tracker=tensorboard")
    run_train(longer, run_dir, resume=True)
    assert_tensorboard_matches(run_dir, 12)
    assert len(list((run_dir / "tensorboard").iterdir())) == 3  # one event file per start


def wandb_history(path: Path) -> list[dict]:
    """The history rows ({"_step": step, name: value}) of a run-ID.wandb file: W&B's record
    log (LevelDB's log format after a 7-byte header: 32 KiB blocks of chunks, each with a
    7-byte header of CRC, length, type) of protobuf Records."""
    import json

    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:16]
    pos, pending, rows = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                row = {}
                for item in record.history.item:
                    row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
                rows.append(row)
    return rows


def test_wandb_offline_run_holds_the_history(tmp_path, corpus_file, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing in ~
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    for name in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    cfg = tiny_config(corpus_file, "train.max_steps=4", "train.tracker=wandb")
    run_dir = tmp_path / "run"
    run_tokenize(cfg, run_dir)
    run_train(cfg, run_dir)
    resumed = tiny_config(corpus_file, "train.max_steps=8", "train.tracker=wandb")
    run_train(resumed, run_dir, resume=True)
    # run.finish() only tells wandb's service process that the run is done: the service
    # writes the file's last records afterwards. teardown() waits for the service to end,
    # as the interpreter's exit does for a user's run.
    wandb.teardown()

    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2, list((run_dir / "wandb").iterdir())  # one run, started twice
    rows = [row for path in files for row in wandb_history(path)]
    expected = jsonl_scalars(run_dir)
    assert [row["_step"] for row in rows] == list(range(1, 9))  # a step's records: one row
    for row in rows:
        step = row["_step"]
        names = {name for name, values in expected.items() if step in values}
        assert names <= set(row), (step, names - set(row))
        for name in names:
            assert row[name] == pytest.approx(expected[name][step], rel=1e-6), (step, name)


def run_main(capsys, *argv) -> tuple[int, list[str]]:
    """tinyllm.main in-process; returns (exit code, non-empty stderr lines)."""
    code = tinyllm.main([str(a) for a in argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("kind", "module", "extra"),
    [("tensorboard", "tensorboardX", "tensorboard"), ("wandb", "wandb", "wandb")],
)
def test_missing_package_is_refused_first(
    tmp_path, corpus_file, capsys, monkeypatch, kind, module, extra
):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    run_dir = tmp_path / "run"
    # The run has no tokenizer yet: the tracker is checked before anything else.
    code, lines = run_main(
        capsys, "--train", "--config", CHAR_CONFIG, "--input", corpus_file, "--out", run_dir,
        *TINY, f"train.tracker={kind}",
    )  # fmt: skip
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (
        f"tinyllm: error: train.tracker={kind} needs {module}: pip install -e '.[{extra}]'"
    )
    assert not (run_dir / "metrics.jsonl").exists()


def test_bad_tracker_is_refused(tmp_path, capsys):
    code, lines = run_main(capsys, "--train", "--out", tmp_path / "run", "train.tracker=foo")
    assert code == 2 and len(lines) == 1, lines
    assert "train.tracker must be one of none, tensorboard, wandb; got 'foo'" in lines[0]
    with pytest.raises(UsageError, match=r"train\.tracker must be one of"):
        tiny_config(Path("x.txt"), "train.tracker=TensorBoard")


def test_none_imports_no_backend(tmp_path, monkeypatch):
    for module in ("tensorboardX", "tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, module, None)
    assert require_tracker("none") is None
    tracker = open_tracker("none", tmp_path, {}, resume_step=None)
    tracker.log(1, {"train_loss": 1.0})
    tracker.close()
    assert list(tmp_path.iterdir()) == []
