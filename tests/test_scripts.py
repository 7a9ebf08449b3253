"""The scripts run from the checkout, from any working directory, and answer a mistake on
their command line in one line (`NAME: error: ... (see --help)`, exit 2), as tinyllm.py does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.script_module import load_script
from tests.tiny_runs import ROOT

SCRIPTS = [
    "bench_engine",
    "bench_generate",
    "bench_moe",
    "bench_products",
    "bench_quant",
    "bench_serve",
    "bench_tokenizer",
    "bench_time_to_loss",
    "bench_train",
    "eval_split",
    "export_hf",
    "make_ttl_texts",
    "quantize",
    "vocab_vs_context",
]


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_bad_flag_is_one_line(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / f"{name}.py"), "--no-such-flag"],
        cwd=tmp_path,  # not the checkout: the script finds the project by its own path
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()  # no usage block, no traceback
    assert line.startswith(f"{name}: error: ") and line.endswith(" (see --help)"), line
    assert "--no-such-flag" in line or "are required" in line, line


def test_time_to_loss_bench_runs_a_nanogpt_checkout_then_tinyllm(tmp_path):
    """The table from a stand-in nanoGPT checkout (its train.py prints nanoGPT's log lines;
    its prepare.py must find the text as input.txt) and a few real tinyllm steps, in two
    alternated pairs: the median times, the pairs' range, and "no" as the second pair's
    nanoGPT reaches a loss tinyllm does not."""
    from tests.tiny_runs import write_word_corpus

    nano = tmp_path / "nanoGPT"
    (nano / "config").mkdir(parents=True)
    (nano / "data" / "shakespeare_char").mkdir(parents=True)
    (nano / "config" / "train_shakespeare_char.py").write_text("")
    (nano / "model.py").write_text("")
    (nano / "configurator.py").write_text("")
    (nano / "data" / "shakespeare_char" / "prepare.py").write_text(
        "import pathlib\nassert pathlib.Path('input.txt').stat().st_size > 0\n"
    )
    # The timed call is the README's command (20 eval batches) saving its checkpoint; the
    # untimed one resumes it and evaluates 200 batches: its loss is the target, 9.5 in the
    # first pair and 0.5 in the second (a count of those calls kept beside the checkout).
    calls = tmp_path / "target_calls"
    (nano / "train.py").write_text(
        "import pathlib, sys\nargs = sys.argv\nassert '--max_iters=2000' in args\n"
        f"calls = pathlib.Path({str(calls)!r})\n"
        "if '--init_from=resume' in args:\n"
        "    assert '--eval_iters=5' in args\n"
        "    n = len(calls.read_text()) if calls.exists() else 0\n"
        "    calls.write_text('x' * (n + 1))\n"
        "    print(f'step 2000: train loss 1.8000, val loss {9.5 if n == 0 else 0.5:.4f}')\n"
        "else:\n"
        "    assert '--eval_iters=20' in args and '--eval_iters=5' not in args\n"
        "    assert '--always_save_checkpoint=True' in args\n"
        "    print('step 0: train loss 4.1000, val loss 4.2000')\n"
        "    print('step 2000: train loss 1.8000, val loss 9.4000')\n"
    )
    text = write_word_corpus(tmp_path / "words.txt", 300)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_time_to_loss.py"), "--nanogpt", str(nano),
         "--input", str(text), "--target-batches", "5", "--repeats", "2", "train.max_steps=4",
         "train.eval_interval=4", "train.eval_steps=2", "train.warmup_steps=1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert calls.read_text() == "xx"  # two pairs, each with its own untimed target
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("| words.txt")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1].startswith("5.0000 in ") and cells[4] == "no", row  # medians; one missed
    ratio, low, high = map(
        float, re.fullmatch(r"([\d.]+)x \(([\d.]+) - ([\d.]+)\)", cells[3]).groups()
    )
    assert low <= ratio <= high  # two pairs' ratio of summed times lies between theirs
    assert "median of 2 pairs" in proc.stdout and "machine: " in proc.stdout  # and the CPU
    pairs = re.findall(r"then on 5: nanoGPT 9\.4000, (\d\.\d+) in [\d.]+ s; tinyllm ", proc.stderr)
    assert pairs == ["9.5000", "0.5000"], proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--repeats", "0"], "--repeats must be at least 1, not 0"),
        (["--ablate", "--repeats", "2"], "--ablate repeats with --seeds"),
        # --input takes several files at once, as tinyllm.py's does: the second is looked for
        (["missing.txt"], "--input missing.txt: no such file"),
        # an override after the files ends them, as in tinyllm.py; tinyllm's overrides are
        # checked before nanoGPT runs, not after its minutes
        (["model.n_layer=0"], "model.n_layer must be a positive integer"),
    ],
)
def test_time_to_loss_bench_refuses_what_it_cannot_run(tmp_path, flags, fragment):
    text = tmp_path / "words.txt"
    text.write_text("to be or not to be\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_time_to_loss.py"), "--input", str(text),
         *flags],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.splitlines()) == 1


def test_time_to_loss_ablation_gives_equal_steps_and_equal_time(tmp_path):
    """--ablate: the fast config and the variants asked for, a row each with the loss at
    the fast config's steps and at its wall time, and every run's figures in --json."""
    from tests.tiny_runs import write_word_corpus

    text = write_word_corpus(tmp_path / "words.txt", 300)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_time_to_loss.py"), "--ablate",
         "--seeds", "1", "--variants", "value embeddings", "--input", str(text),
         "--target-batches", "2", "--json",
         str(tmp_path / "runs.json"), "train.max_steps=4", "train.eval_interval=4",
         "train.eval_steps=2", "train.warmup_steps=1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["the fast config", "no value embeddings"]
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and cells[2].endswith(" ms") and float(cells[4]) > 0
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert {r["variant"] for r in runs} == {"the fast config", "no value embeddings"}
    assert all(r["steps"] > 0 and r["step_s"] > 0 for r in runs)


def test_serve_bench_starts_a_server_measures_and_stops_it(tmp_path):
    """End to end on a tiny char run (no end-of-text token: every request makes all its
    tokens): the table, no failed request, tokens counted exactly, and the CPU time the
    clients and the server (started here, so its /proc is read) spent in each wave."""
    from tests.tiny_runs import train_tiny_run

    run_dir = train_tiny_run(tmp_path, "train.max_steps=4")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_serve.py"), "--run", str(run_dir),
         "--clients", "1", "2", "--max-tokens", "4", "--repeats", "1", "--sequential", "2",
         "--prompt", "to be or", "--json", str(tmp_path / "serve.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| clients | requests | tokens/s |")
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows[1:]]
    assert [(c[0], c[1], c[-1]) for c in cells] == [("1", "1", "0"), ("2", "2", "0")]
    assert "2 concurrent / sequential: " in proc.stdout
    (run,) = json.loads((tmp_path / "serve.json").read_text())["runs"]
    result = run["result"]
    for summary in [*result["clients"], result["sequential"]]:
        assert summary["tokens"] == 4 * summary["requests"] and summary["failed"] == 0
        # the server's in clock ticks (10 ms): a tiny wave may take less than one
        assert summary["client_cpu_s"] > 0 and summary["server_cpu_s"] >= 0
    assert all(float(c[-3]) > 0 and float(c[-2]) >= 0 for c in cells)  # not "-"
    assert "one request: decode" in proc.stdout and result["inference_per_s"] > 0


def test_engine_bench_times_waves_and_every_row_count(tmp_path):
    """End to end on a tiny char run: a wave row per client count with positive rates and
    parts, a chunk row for each row count the engine compiled, and with --profile a trace
    of 1 row and of all rows (a CPU's has no device timeline, which it says)."""
    from tests.tiny_runs import train_tiny_run

    run_dir = train_tiny_run(tmp_path, "train.max_steps=4")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_engine.py"), "--run", str(run_dir),
         "--rows", "4", "--clients", "1", "3", "--max-tokens", "6", "--repeats", "1",
         "--prompt", "to be or", "--profile", str(tmp_path / "prof")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [
        line.strip("|").split("|") for line in proc.stdout.splitlines() if line.startswith("| ")
    ]
    waves = [r for r in rows if len(r) == 5 and r[0].strip().isdigit()]
    assert [r[0].strip() for r in waves] == ["1", "3"]
    assert all(float(cell.replace(",", "")) > 0 for r in waves for cell in r[1:3])
    chunks = [r for r in rows if len(r) == 3 and r[0].strip().isdigit()]
    assert sorted({int(r[0]) for r in chunks}) == [1, 4] and all(float(r[2]) > 0 for r in chunks)
    for rows in (1, 4):
        assert len(list((tmp_path / "prof" / f"rows{rows}").glob("**/perfetto_trace.json.gz"))) == 1
    assert proc.stdout.count("no device timeline in the trace") == 2


def test_products_bench_times_a_runs_own_products_and_the_gain_they_allow(tmp_path):
    """A tiny char run's products: its blocks' kernels and then the output layer, chained as
    a step chains them (XLA's chain equals numpy's); a table row per row count with positive
    times, and the gain line that 16 rows' time against one row's gives."""
    import jax.numpy as jnp
    import numpy as np

    from model.rundir.trained import load_for_sampling
    from tests.tiny_runs import train_tiny_run

    run_dir = train_tiny_run(tmp_path, "train.max_steps=2")
    bench = load_script("bench_products")
    _, model = load_for_sampling(run_dir, None, None)
    kernels = bench.step_kernels(model)
    cfg = model.cfg
    assert len(kernels) == 4 * cfg.n_layer + 1
    assert kernels[-1].shape == (cfg.n_embd, cfg.vocab_size)
    x = np.random.default_rng(0).standard_normal((3, cfg.n_embd), dtype=np.float32)
    by_hand = x
    for w in kernels:  # each input cut or zero-padded to the kernel's width
        k = w.shape[0]
        by_hand = np.pad(by_hand, ((0, 0), (0, max(0, k - by_hand.shape[1]))))[:, :k] @ w
    pad = lambda a, k: jnp.pad(a, ((0, 0), (0, k - a.shape[1])))  # noqa: E731
    got = bench.chained(jnp.matmul, pad, jnp.asarray(x), [jnp.asarray(w) for w in kernels])
    np.testing.assert_allclose(np.asarray(got), by_hand, rtol=1e-4, atol=1e-4)

    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_products.py"), "--run", str(run_dir),
         "--rows", "1", "16", "--repeats", "3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    rows = [line.strip("|").split("|") for line in lines if line.startswith("| ")]
    table = [r for r in rows if r[0].strip().isdigit()]
    assert [int(r[0]) for r in table] == [1, 16]
    assert all(float(cell) > 0 for r in table for cell in r[1:])
    gain = re.search(r"batching 16 rows gains at most ([0-9.]+)x", proc.stdout)
    ms = {int(r[0]): float(r[1]) for r in table}
    expected = 16 * ms[1] / ms[16]  # from the rounded times: within their rounding
    assert gain and abs(float(gain.group(1)) - expected) < 0.1 + 0.2 * expected
    assert "GFLOP/s" in lines[-2]


def test_device_trace_counts_a_device_s_kernels_per_step(tmp_path):
    """scripts/device_trace.py on a Perfetto trace written here: two steps of three kernels on
    a GPU stream; host events and other processes are not counted."""
    import gzip

    from scripts.device_trace import summary  # a namespace package from the checkout

    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    kernels = [("dot", 10), ("softmax", 4), ("dot", 10)] * 2
    events, ts = [], 100
    for name, dur in kernels:
        events.append({"ph": "X", "pid": 1, "tid": 7, "name": name, "ts": ts, "dur": dur})
        ts += dur + 1  # a microsecond between kernels
    events.append({"ph": "X", "pid": 2, "tid": 3, "name": "PjitFunction", "ts": 0, "dur": 500})
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events[::-1]}, f)  # out of order, as files may be
    found = summary(path, steps=2, top=1)
    assert found["kernels_per_step"] == 3
    assert found["busy_ms_per_step"] == pytest.approx(0.024)
    assert found["span_ms_per_step"] == pytest.approx((ts - 1 - 100) / 1e3 / 2)
    assert found["top"] == [("dot", pytest.approx(0.02), 2)]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta[1:] + events[-1:]}, f)
    assert summary(path, steps=2) is None


def test_time_to_loss_texts_are_cut_from_the_packages_in_order(tmp_path, monkeypatch):
    """make_ttl_texts assembles each text from its package's files in the documented order,
    cut to length, and refuses a text that came out short."""
    import gzip

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # it imports make_bench_corpus beside it
    import make_ttl_texts as m

    root = tmp_path / "tree"

    def put(path: str, text: str, gz: bool = False) -> None:
        f = root / path
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(gzip.compress(text.encode()) if gz else text.encode())

    put("usr/share/dictd/gcide.dict.dz", "first half\nsecond\nhalf and more\n", gz=True)
    sources = "usr/share/doc/python3.11/html/_sources"
    for name in ("tutorial/b.rst.txt", "tutorial/a.rst.txt", "faq/z.rst.txt", "howto/h.rst.txt"):
        put(f"{sources}/{name}", name.split("/")[1][0])
    put(f"{sources}/extending/extending.rst.txt", "E")
    put(f"{sources}/extending/newtypes_tutorial.rst.txt", "N")
    put(f"{sources}/library/skipped.rst.txt", "X")
    for name, text in [("perlop.pod", "o"), ("perlfaq1.pod", "q"), ("perlguts.pod", "X")]:
        put(f"usr/share/perl/5.36/pod/{name}", text)
    guide = "usr/share/doc/linux-doc-6.1/Documentation/admin-guide"
    put(f"{guide}/b/x.rst.gz", "2", gz=True)
    put(f"{guide}/a.rst.gz", "1", gz=True)
    for name, text in [("zen", "Z"), ("art", "A"), ("art.dat", "X"), ("art.u8", "X")]:
        put(f"usr/share/games/fortunes/{name}", text)

    assert m.dictionary(root) == "half and more\n"  # from the line break after the midpoint
    assert m.pydocs(root) == "abhzEN"  # tutorial, howto, faq, then the two extending pages
    assert m.perl(root) == "qo"  # perlfaq*, perlop: sorted by path; perlguts is not taken
    assert m.linux(root) == "12"
    assert m.fortunes(root) == "AZ"

    written = m.write_texts(root, tmp_path / "out", length=2)
    assert [p.read_text() for p in written] == ["ha", "ab", "qo", "12", "AZ"]
    with pytest.raises(SystemExit, match="perl has 2 characters, not 3"):
        m.write_texts(root, tmp_path / "out", length=3)


def test_eval_split_scores_as_training_did_or_every_window(tmp_path, capsys):
    """--batches N is training's own evaluation over its first N fixed validation batches: on
    a run that evaluated N batches it gives the logged loss (the time-to-loss bench scores
    its runs so); without it, every window of the split."""
    from tests.tiny_runs import train_tiny_run

    run = train_tiny_run(tmp_path, "train.max_steps=4", "train.eval_steps=3")
    script = load_script("eval_split")

    def scored(*flags: str) -> dict:
        capsys.readouterr()
        assert script.main(["--run", str(run), *flags]) == 0
        return json.loads(capsys.readouterr().out.splitlines()[-1])

    three, eight, windows = scored("--batches", "3"), scored("--batches", "8"), scored()
    assert three["step"] == 4 and three["batches"] == 3
    assert three["val_loss_batches"] == three["val_loss_logged"]
    assert eight["val_loss_batches"] != three["val_loss_batches"]  # more batches, more seen
    assert windows["windows"] > 0 and windows["val_loss_all_windows"] > 0
    assert "val_loss_batches" not in windows
