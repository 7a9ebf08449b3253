"""The stop-string scan (model/serving/text.py): the text before the first stop string for any
split of the text into pieces, and a scan linear in the text."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from model.serving.text import StopText


def first_stop(text: str, stops: list[str]) -> str:
    """Reference: the text before the first stop string to be completed (at the same end,
    the one that starts first)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if s and text[:end].endswith(s)]
        if starts:
            return text[: min(starts)]
    return text


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text("abc", min_size=1, max_size=5), max_size=4),
    st.lists(st.text("abc", max_size=4), max_size=8),
)
def test_stop_text_matches_the_reference_for_any_split(stops, parts):
    text = StopText(stops)
    out = "".join(text.feed(p.encode()) for p in parts) + text.finish()
    assert out == first_stop("".join(parts), stops)


def test_the_stop_scan_is_linear_in_the_text():
    # Four stop strings of 3,000-4,000 characters that the text keeps almost matching: the
    # scan held back and re-checked every candidate end, quadratic in the stop length per
    # token (hours here); one automaton step per character takes well under a second.
    stops = ["x" * 3000 + "y", "x" * 4000 + "z", "x" * 3500 + "w", "x" * 3999 + "v"]
    text = StopText(stops)
    started = time.perf_counter()
    sent = "".join(text.feed(b"xxxxxxxx") for _ in range(2000))
    assert time.perf_counter() - started < 20  # a complexity guard, not a speed target
    assert sent == "x" * (16_000 - 4000) and not text.stopped
