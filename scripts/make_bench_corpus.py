"""Assemble the ~103 MB real-text benchmark corpus from four Debian packages (Debian 12).

    python scripts/make_bench_corpus.py /tmp/bench/debian-docs.txt

Downloads the packages with `apt-get download` (no install, no root needed beyond apt's cache
being readable), extracts them with `dpkg-deb -x` into a work directory, and concatenates, in
sorted path order, one file after another:

- linux-doc-6.1: the kernel's Documentation/ tree (reStructuredText and plain text, ~42 MB);
- python3.11-doc: the reStructuredText sources of Python's documentation (~11 MB);
- perl-doc: Perl's POD manuals (~9 MB);
- dict-gcide: the GNU Collaborative International Dictionary of English (~40 MB).

Technical prose plus a dictionary: real English text with code, tables and markup, the kind of
corpus a small model is trained on. Bytes that are not UTF-8 are replaced (U+FFFD). The
corpus is written to the path given, never into the repository.
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ["linux-doc-6.1", "python3.11-doc", "perl-doc", "dict-gcide"]


def texts(root: Path) -> Iterator[tuple[Path, bytes]]:
    """(path, raw bytes) of every corpus file under the extracted tree, in a fixed order."""
    docs = root / "usr/share/doc"
    for path in sorted((docs / "linux-doc-6.1/Documentation").rglob("*.gz")):
        yield path, gzip.decompress(path.read_bytes())
    for path in sorted((docs / "python3.11/html/_sources").rglob("*.rst.txt")):
        yield path, path.read_bytes()
    for path in sorted((root / "usr/share/perl").rglob("*.pod")):
        yield path, path.read_bytes()
    dictionary = root / "usr/share/dictd/gcide.dict.dz"  # dictzip is gzip-compatible
    yield dictionary, gzip.decompress(dictionary.read_bytes())


def unpacked(packages: list[str], work: Path) -> Path:
    """Download Debian `packages` into `work` (apt-get download) and extract them all into
    one tree, `work`/tree, which is returned."""
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", *packages], cwd=work, check=True)
    root = work / "tree"
    for deb in sorted(work.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        print(f"{Path(sys.argv[0]).stem}: {deb.name}", file=sys.stderr)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the corpus file to write")
    parser.add_argument("--workdir", type=Path, help="where to download and extract")
    args = parser.parse_args()
    root = unpacked(PACKAGES, args.workdir or Path(tempfile.mkdtemp(prefix="bench-corpus-")))
    size = files = 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for _, data in texts(root):
            text = data.decode("utf-8", errors="replace")
            f.write(text if text.endswith("\n") else text + "\n")
            size += len(text.encode("utf-8"))
            files += 1
    print(f"make_bench_corpus: {files} files, {size / 1e6:.1f} MB -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
