"""Training's kept programs (model/training/kept_programs.py): a second run of a config reads
its step, evaluation and initialisation from the program cache, traces nothing and trains
exactly as the first; an entry that is damaged, or loads and then does not run, is compiled
again; a program JAX holds in its own disk cache is compiled anyway, and kept."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.decoding.program_cache import ProgramCache
from model.network.config import ModelConfig
from model.training import kept_programs
from model.training.config import TrainConfig
from model.training.data import TokenSplits
from model.training.kept_programs import KeptProgram, kept
from model.training.trainer import Trainer, seed_key
from tests.jax_events import COMPILE_EVENT, TRACE_EVENT, jax_events
from tests.tiny_runs import ROOT, TINY_TRAIN, run_python_json, write_word_corpus
from tokenizer.io import load_tokenizer

PROGRAMS = {"train-init-params", "train-init-optimizer", "train-step", "train-evaluation"}
KINDS = PROGRAMS | {"train-initial-params"}  # the initialiser's output is kept too
# What a second run of a config logs of its kept programs, sorted (see the first test).
SECOND_RUN_READS = [
    "train-evaluation: kept program read ahead",
    "train-init-optimizer: kept program read ahead",
    "train-step: kept program read ahead from the config",
]
_NEW_SIZES = itertools.count(3)


@pytest.fixture(autouse=True)
def jax_keeps_nothing_on_disk():
    """JAX stores no new program in its disk cache here (an in-process --train may have
    switched it on): a program read back from it is, rightly, not kept."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def entries(folder: Path) -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in sorted(folder.glob("train-*.bin")):
        found.setdefault(path.name.rsplit("-", 1)[0], []).append(path)
    return found


def train(tmp_path: Path, out: str, cache: Path, *extra: str, corpus: Path | None = None):
    """`tinyllm.py --tokenize --train` in a process of its own on two CPU devices (on
    `corpus`, or a word corpus); the debug log's lines about kept programs."""
    corpus = corpus or write_word_corpus(tmp_path / "corpus.txt", 60)
    argv = [sys.executable, str(ROOT / "tinyllm.py"), "--tokenize", "--train", "--debug"]
    argv += ["--config", "shakespeare_char", "--input", str(corpus), "--out", str(tmp_path / out)]
    argv += [*TINY_TRAIN, "train.max_steps=6", "train.cpu_devices=2", *extra]
    env = {**os.environ, "TINYLLM_XLA_CACHE": str(cache)}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if "kept program" in line]


def metrics(run: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in ("elapsed_s", "tokens_per_sec")}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


def test_a_second_run_reads_every_program_and_trains_the_same(tmp_path):
    cache = tmp_path / "cache"
    first = train(tmp_path, "first", cache)
    assert set(entries(cache / "programs")) == KINDS
    assert all("compiled" in line for line in first) and len(first) == len(PROGRAMS)
    second = train(tmp_path, "second", cache)
    # A fresh run's programs are read ahead (Trainer.prefetch_programs), for the signatures
    # the run then calls them with: read once, not again on the first call. The first call's
    # step is read before the trainer exists, from the config alone (ReadAhead). The
    # initialiser's program is not read at all: its output, the parameters, is kept.
    assert sorted(line.split("debug: ")[-1] for line in second) == SECOND_RUN_READS
    assert metrics(tmp_path / "second") == metrics(tmp_path / "first")
    # Another learning rate is another program (the schedule's constants), not the kept one.
    third = train(tmp_path, "third", cache, "train.learning_rate=1e-3")
    assert "train-step: kept program compiled" in "\n".join(third)
    # Each config points at its program, kept once under a digest of its lowered text (and
    # at the entry its first call reads ahead).
    assert len(entries(cache / "programs")["train-step"]) == 6
    assert metrics(tmp_path / "third")[-1] != metrics(tmp_path / "first")[-1]
    # A config that differs where the programs do not (how often it logs) finds them under
    # their text: it compiles nothing and trains as the first.
    fourth = train(tmp_path, "fourth", cache, "train.log_interval=2")
    assert len(fourth) == len(PROGRAMS) and not [line for line in fourth if "compiled" in line]
    logged = metrics(tmp_path / "fourth")
    assert len(logged) < len(metrics(tmp_path / "first"))
    assert all(record in metrics(tmp_path / "first") for record in logged)
    assert len(entries(cache / "programs")["train-step"]) == 8  # its pointers only


def test_texts_of_other_characters_share_programs_when_the_vocabulary_is_padded(tmp_path):
    """tokenizer.pad_to_multiple gives texts of different character sets one vocabulary
    size, so a run of one text reads every program that the run of another kept."""
    cache, pad = tmp_path / "cache", "tokenizer.pad_to_multiple=32"
    first = train(tmp_path, "first", cache, pad)
    assert all("compiled" in line for line in first) and len(first) == len(PROGRAMS)
    other = tmp_path / "other.txt"  # other words, other letters (and capitals)
    other.write_text("Quick brown foxes jump over lazy dogs; zebras vex him.\n" * 60)
    second = train(tmp_path, "second", cache, pad, corpus=other)
    assert sorted(line.split("debug: ")[-1] for line in second) == SECOND_RUN_READS
    chars = [load_tokenizer(tmp_path / run / "tokenizer.pkl").chars for run in ("first", "second")]
    assert set(chars[0]) != set(chars[1]) and len(chars[0]) == len(chars[1]) == 32


def test_a_trainer_whose_programs_are_kept_traces_and_compiles_nothing(tmp_path):
    """The warm path in one process: a second trainer of a config reads the programs it runs,
    and its first state (the key too) and the evaluation's running sum are made on the host."""
    cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    t = TrainConfig(batch_size=4, eval_steps=2, eval_batch_size=4, seed=2**32 - 1)
    tokens = np.arange(400, dtype=np.uint16) % 64
    splits = TokenSplits(train=tokens, val=tokens, val_bytes=len(tokens))

    def train_and_evaluate(trainer: Trainer) -> tuple[float, float]:
        state = trainer.initial_state()
        state, metrics = trainer.train_step(state, *trainer.batch(tokens, 0))
        return float(metrics["loss"]), trainer.evaluate(state.params, splits)

    first = train_and_evaluate(Trainer(t, cfg, programs=ProgramCache(tmp_path)))
    second_trainer = Trainer(t, cfg, programs=ProgramCache(tmp_path))
    with jax_events(TRACE_EVENT, COMPILE_EVENT) as events:
        second = train_and_evaluate(second_trainer)
    assert events == [] and second == first


@pytest.mark.parametrize("seed", [0, 1337, 2**31 - 1, 2**31, 2**32 - 1])
def test_the_host_made_key_is_jax_random_key(seed):
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()), ("d",)), jax.sharding.PartitionSpec()
    )
    key = seed_key(seed, sharding)
    expected = jax.random.key(seed, impl="threefry2x32")
    assert key.dtype == expected.dtype and key.sharding == sharding
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(expected))
    np.testing.assert_array_equal(
        jax.random.uniform(jax.random.fold_in(key, 3), (4,)),
        jax.random.uniform(jax.random.fold_in(expected, 3), (4,)),
    )


def program(cache: ProgramCache, size: int) -> KeptProgram:
    jitted = jax.jit(lambda x, y: (x * 2.0 + y, {"sum": jnp.sum(x)}), donate_argnums=0)
    return KeptProgram(jitted, cache, "train-test", {"size": size}, jax.local_devices()[:1])


def run_program(prog: KeptProgram, size: int):
    x = jnp.arange(size, dtype=jnp.float32)
    out, aux = prog(x, jnp.ones(size, jnp.float32))
    assert x.is_deleted()  # donated, as the jitted function donates it
    return np.asarray(out), float(aux["sum"])


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    calls: list[str] = []
    original = KeptProgram._compile_and_keep

    def counted(self, args, *given):
        calls.append(self.kind)
        return original(self, args, *given)

    monkeypatch.setattr(KeptProgram, "_compile_and_keep", counted)
    return calls


def test_a_kept_program_gives_what_the_jitted_one_gives(tmp_path, compiles):
    size, cache = next(_NEW_SIZES), ProgramCache(tmp_path)
    expected = run_program(program(cache, size), size)
    # The program under its text, and this config's pointer to it.
    assert len(compiles) == 1 and len(list(tmp_path.glob("train-test-*.bin"))) == 2
    loaded = run_program(program(cache, size), size)
    assert len(compiles) == 1  # read, not compiled
    np.testing.assert_array_equal(loaded[0], expected[0])
    assert loaded[1] == expected[1] == sum(range(size))
    np.testing.assert_array_equal(expected[0], 2.0 * np.arange(size) + 1)


@pytest.mark.parametrize("damage", ["flipped-bit", "truncated"])
def test_a_damaged_entry_is_compiled_again(tmp_path, compiles, damage):
    size, cache = next(_NEW_SIZES), ProgramCache(tmp_path)
    expected = run_program(program(cache, size), size)
    path = max(tmp_path.glob("train-test-*.bin"), key=lambda p: p.stat().st_size)  # the program
    data = bytearray(path.read_bytes())
    if damage == "flipped-bit":
        data[len(data) // 2] ^= 0x10
    else:
        del data[len(data) // 3 :]
    path.write_bytes(bytes(data))
    got = run_program(program(cache, size), size)
    assert len(compiles) == 2
    np.testing.assert_array_equal(got[0], expected[0])


def test_an_entry_that_loads_and_does_not_run_is_compiled_again(tmp_path, compiles, monkeypatch):
    """What XLA:CPU does with an executable it read from JAX's disk cache and serialized again:
    it loads, then its first call fails, before anything was donated."""
    size, cache = next(_NEW_SIZES), ProgramCache(tmp_path)
    expected = run_program(program(cache, size), size)

    def broken(*args):
        raise RuntimeError("Function main.1 not found")

    monkeypatch.setattr(kept_programs, "loaded", lambda part: broken)
    got = run_program(program(cache, size), size)
    assert len(compiles) == 2
    np.testing.assert_array_equal(got[0], expected[0])


def test_a_program_read_ahead_from_shapes_runs_as_the_one_read_on_call(tmp_path, compiles):
    size, cache = next(_NEW_SIZES), ProgramCache(tmp_path)
    expected = run_program(program(cache, size), size)
    reads = []
    prog = program(cache, size)
    original = prog._read_part
    prog._read_part = lambda entry: reads.append(entry) or original(entry)
    like = jax.ShapeDtypeStruct((size,), jnp.float32, sharding=jnp.ones(1).sharding)
    prog.prefetch(like, like)
    prog.prefetch(like, like)  # asked twice: read once
    got = run_program(prog, size)
    assert len(reads) == 1 and len(compiles) == 1  # the first call took the read-ahead one
    np.testing.assert_array_equal(got[0], expected[0])
    # Shapes with no kept program: nothing is compiled ahead; the call compiles.
    other = jax.ShapeDtypeStruct((size + 50,), jnp.float32, sharding=like.sharding)
    prog.prefetch(other, other)
    run_program(prog, size + 50)
    assert len(reads) == 3 and len(compiles) == 2  # read ahead, then under its text: none


def test_new_shapes_compile_a_program_of_their_own(tmp_path, compiles):
    size, cache = next(_NEW_SIZES), ProgramCache(tmp_path)
    prog = program(cache, size)
    run_program(prog, size)
    run_program(prog, size + 100)  # a batch-size schedule's next size
    run_program(prog, size)
    assert len(compiles) == 2 and len(list(tmp_path.glob("train-test-*.bin"))) == 4


def test_without_a_cache_or_with_several_processes_the_jitted_function_runs(tmp_path, monkeypatch):
    jitted = jax.jit(lambda x: x + 1)
    devices = jax.local_devices()[:1]
    assert kept(jitted, None, "train-test", {}, devices) is jitted
    assert isinstance(kept(jitted, ProgramCache(tmp_path), "train-test", {}, devices), KeptProgram)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert kept(jitted, ProgramCache(tmp_path), "train-test", {}, devices) is jitted


KEEP_SCRIPT = """
import sys, jax, jax.numpy as jnp, numpy as np
from model.decoding.program_cache import ProgramCache
from model.training.kept_programs import KeptProgram
jax_dir, ours, first = sys.argv[1:]
if jax_dir:
    jax.config.update("jax_compilation_cache_dir", jax_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
def f(x):
    for _ in range(4):
        x = jnp.tanh(x @ x.T) + 1.0
    return x
x = jnp.arange(64.0).reshape(8, 8) / 64
if first == "jit-first":  # JAX compiles it and keeps it in its own disk cache
    jax.block_until_ready(jax.jit(f)(x))
    jax.clear_caches()
devices = jax.local_devices()[:1]
out = KeptProgram(jax.jit(f), ProgramCache(ours), "train-test", {}, devices)(x)
print(np.asarray(out).tolist())
"""


def test_a_program_jax_holds_in_its_own_disk_cache_is_kept_all_the_same(tmp_path):
    """An earlier version (or a run with another tinyllm source) left the program in JAX's
    cache: it is compiled here anyway, so the entry is written and runs in the next process."""
    jax_dir, ours = tmp_path / "jax", tmp_path / "ours"

    def run(*argv: str) -> list:
        return run_python_json(KEEP_SCRIPT, *argv)

    compiled = run(str(jax_dir), str(ours), "jit-first")
    assert any(jax_dir.iterdir())  # JAX kept the jitted program
    assert len(list(ours.glob("train-test-*.bin"))) == 2  # ours was compiled, kept, pointed at
    assert run("", str(ours), "-") == compiled  # a new process runs the kept executable


@pytest.mark.parametrize("fresh", [True, False])
def test_only_a_fresh_run_reads_its_initialisers_ahead(tmp_path, fresh):
    """A resumed run (or one that starts from a checkpoint's weights) makes no fresh state:
    its initialisers are not read; the step and evaluation are, either way."""
    from configs.schema import load_config
    from model.decoding.program_cache import ProgramCache
    from model.training.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "shakespeare_char.toml", TINY_TRAIN)
    trainer = Trainer(cfg.train, cfg.model.for_vocab(16), programs=ProgramCache(tmp_path))
    trainer.prefetch_programs(fresh=fresh)
    for program in (trainer._init_params, trainer._init_opt_state):
        assert bool(program._reading) is fresh
    assert trainer.train_step._reading and trainer.eval_batches._reading
