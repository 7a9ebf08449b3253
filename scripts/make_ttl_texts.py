"""Assemble the English texts that docs/recipe.md measures time to loss on, from Debian 12's
packages: each as long as Tiny Shakespeare (1,115,394 characters), none of them what the fast
config was written for.

    python scripts/make_ttl_texts.py /tmp/ttl-texts
    python scripts/bench_time_to_loss.py --nanogpt ~/nanoGPT --input /tmp/ttl-texts/*.txt

Downloads the packages with `apt-get download` (scripts/make_bench_corpus.py's way), extracts
them, and writes, each cut to length:
- dictionary.txt: the GNU Collaborative International Dictionary of English (dict-gcide),
  from the first line break after its midpoint: headwords, etymologies, definitions;
- pydocs.txt: Python's documentation (python3.11-doc), the .rst.txt sources of its tutorial,
  howto and faq folders, each in sorted order, then extending.rst.txt and
  newtypes_tutorial.rst.txt: prose with code;
- perl.txt: Perl's manuals (perl-doc), perlfaq*, perlfunc, perlop, perlre* and perlsyn in
  sorted path order: reference prose with code;
- linux.txt: the Linux kernel's admin guide (linux-doc-6.1), Documentation/admin-guide in
  sorted path order: reStructuredText prose;
- fortunes.txt: the fortune cookie files (fortunes, fortunes-min) in sorted order:
  quotations, jokes and verse.

Tiny Shakespeare is not among them: nanoGPT's data/shakespeare_char/prepare.py downloads it.
Bytes that are not UTF-8 are replaced (U+FFFD). The texts are written to the folder given,
never into the repository.
"""

from __future__ import annotations

import gzip
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a clone, uninstalled

from make_bench_corpus import unpacked  # noqa: E402  (this script's folder is on sys.path)

from plumbing.cli import OneLineParser  # noqa: E402

LENGTH = 1_115_394  # Tiny Shakespeare's characters
PACKAGES = ["dict-gcide", "python3.11-doc", "perl-doc", "linux-doc-6.1", "fortunes", "fortunes-min"]
PERL_PAGES = ("perlfaq", "perlfunc", "perlop", "perlre", "perlsyn")  # name prefixes


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def dictionary(root: Path) -> str:
    whole = _text(gzip.decompress((root / "usr/share/dictd/gcide.dict.dz").read_bytes()))
    return whole[whole.index("\n", len(whole) // 2) + 1 :]


def pydocs(root: Path) -> str:
    sources = root / "usr/share/doc/python3.11/html/_sources"
    folders = ("tutorial", "howto", "faq")
    paths = [p for d in folders for p in sorted((sources / d).glob("*.rst.txt"))]
    paths += [sources / f"extending/{name}.rst.txt" for name in ("extending", "newtypes_tutorial")]
    return "".join(_text(p.read_bytes()) for p in paths)


def perl(root: Path) -> str:
    pods = sorted((root / "usr/share/perl").rglob("*.pod"))
    return "".join(_text(p.read_bytes()) for p in pods if p.name.startswith(PERL_PAGES))


def linux(root: Path) -> str:
    guide = root / "usr/share/doc/linux-doc-6.1/Documentation/admin-guide"
    return "".join(_text(gzip.decompress(p.read_bytes())) for p in sorted(guide.rglob("*.gz")))


def fortunes(root: Path) -> str:
    folder = root / "usr/share/games/fortunes"
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.suffix)  # no .dat, .u8
    return "".join(_text(p.read_bytes()) for p in files)


TEXTS: dict[str, Callable[[Path], str]] = {
    "dictionary": dictionary,
    "pydocs": pydocs,
    "perl": perl,
    "linux": linux,
    "fortunes": fortunes,
}


def write_texts(root: Path, out: Path, length: int = LENGTH) -> list[Path]:
    """Each of TEXTS from the extracted tree `root`, cut to `length` characters, as
    `out`/NAME.txt; a text shorter than that is an error (the packages changed)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, assemble in TEXTS.items():
        text = assemble(root)
        if len(text) < length:
            raise SystemExit(f"make_ttl_texts: {name} has {len(text):,} characters, not {length:,}")
        path = out / f"{name}.txt"
        path.write_text(text[:length], encoding="utf-8")
        written.append(path)
    return written


def main() -> None:
    parser = OneLineParser(prog="make_ttl_texts.py", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write the texts into")
    parser.add_argument("--workdir", type=Path, help="where to download and extract")
    args = parser.parse_args()
    root = unpacked(PACKAGES, args.workdir or Path(tempfile.mkdtemp(prefix="ttl-texts-")))
    for path in write_texts(root, args.out):
        print(f"make_ttl_texts: {path}")


if __name__ == "__main__":
    main()
