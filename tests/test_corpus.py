"""Corpus loading: files in pieces, clear errors, local datasets, the rendered plays."""

import json

import pytest

from plumbing.errors import UsageError
from tokenizer import corpus as corpus_mod
from tokenizer.corpus import dataset_corpus, file_corpus, load_corpus, render_play


def test_file_pieces_rejoin_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod, "PIECE_BYTES", 7)  # force many pieces, cut mid-character
    text = "héllo wörld\nΣπάρτη 🙂 and a long line without breaks " * 5 + "\nend"
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    pieces = list(file_corpus([path]).iter_texts())
    assert len(pieces) > 5
    assert "".join(pieces) == text


def test_non_utf8_names_the_offset(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"fine text\n" + "caf\xe9".encode("latin-1"))
    with pytest.raises(UsageError, match=r"not UTF-8 text: invalid byte 0xe9 at byte offset 13"):
        file_corpus([path]).read_text()


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(UsageError, match="input file not found"):
        file_corpus([tmp_path / "missing.txt"])
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(UsageError, match="empty"):
        file_corpus([empty])
    with pytest.raises(UsageError, match="not a regular file"):
        file_corpus([tmp_path])


def test_fingerprint_changes_with_content(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("one")
    before = file_corpus([path]).fingerprint
    path.write_text("one two")
    assert file_corpus([path]).fingerprint != before


def test_render_play_layout():
    md = (
        "# Play\n\n## ACT I\n\n_Enter HORATIO and\nMARCELLUS_\n\n**HORATIO**  \n"
        "Do, if it will not stand.  \nAnd \\--more.\n\n__\\[Aside]_  \n**ALL**  \nAy.\n\n_Exeunt_\n"
    )
    assert render_play(md) == "HORATIO:\nDo, if it will not stand.\nAnd --more.\n\nALL:\nAy.\n\n"


def test_default_corpus_is_the_plays():
    corpus = load_corpus()
    text = corpus.read_text()
    assert len(text) > 4_000_000
    assert "ROMEO:\n" in text and "HAMLET:\n" in text
    assert "**" not in text and "\n_" not in text


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_local_dataset_files_through_the_hf_loader(tmp_path, kind):
    rows = ["First story.\nTwo lines.", "Second story."]
    if kind == "txt":
        path = tmp_path / "data.txt"
        path.write_text("First story.\nTwo lines.\n")
        expected = "First story.\n\n\nTwo lines.\n"  # the text builder: one record per line
    else:
        path = tmp_path / "data.jsonl"
        path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
        expected = "First story.\nTwo lines.\n\nSecond story."
    text = dataset_corpus(str(path)).read_text()
    assert text == expected


def test_a_hub_dataset_says_it_is_reached_for_and_fails_in_one_line(monkeypatch, capsys):
    # offline, the hub client retried for about 25 s with a warning line per retry
    datasets = pytest.importorskip("datasets")

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/stories' on the Hub (offline)\nmore")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(UsageError, match=r"^cannot open dataset 'someone/stories': Couldn't reach"):
        dataset_corpus("someone/stories").read_text()
    assert capsys.readouterr().err == "dataset: opening someone/stories on the Hugging Face hub\n"


def test_dataset_missing_field(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"story": "x"}) + "\n")
    with pytest.raises(UsageError, match=r"no field 'text'.*story"):
        dataset_corpus(str(path)).read_text()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("rows.jsonl", b"not json\n", "JSON parse error"),
        ("empty.jsonl", b"", "the file is empty"),
        ("rows.csv", b'text\n"unterminated\n', "EOF inside string"),
        ("rows.txt", b"\xff\xfeabc", "can't decode byte 0xff"),
    ],
)
def test_a_dataset_file_that_does_not_read_is_one_line(tmp_path, name, content, message):
    # each was a library traceback (pyarrow, pandas, a stray StopIteration, UnicodeDecodeError)
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UsageError, match=message) as err:
        dataset_corpus(str(path)).read_text()
    assert str(err.value).startswith(f"cannot read dataset {str(path)!r}")
    assert "\n" not in str(err.value)


def test_a_split_or_config_of_a_dataset_file_is_refused(tmp_path):
    # one file is one split: --split validation read the whole file without a word
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "hello"}\n')
    for split, config in (("validation", ""), ("train", "en")):
        with pytest.raises(UsageError, match="has one split and no configs"):
            dataset_corpus(str(path), config=config, split=split).read_text()


def test_input_and_dataset_together_is_an_error(tmp_path):
    with pytest.raises(UsageError, match="not both"):
        load_corpus(inputs=["a.txt"], dataset="x")
