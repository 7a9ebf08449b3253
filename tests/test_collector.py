"""The garbage collector during start-up (plumbing/collector.py): fewer passes while the process
starts, start-up's objects frozen once the work begins, the thresholds always put back."""

from __future__ import annotations

import gc

import pytest

import tinyllm
from plumbing.collector import START_UP_THRESHOLD, start_up, start_up_done
from plumbing.lazy import import_in_background


@pytest.fixture(autouse=True)
def thresholds_kept():
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)
    gc.unfreeze()  # the frozen objects go back to the oldest generation


def test_start_up_raises_the_threshold_and_puts_it_back_after_an_error(thresholds_kept):
    with pytest.raises(RuntimeError), start_up():
        assert gc.get_threshold() == (START_UP_THRESHOLD, *thresholds_kept[1:])
        raise RuntimeError("a stage failed")
    assert gc.get_threshold() == thresholds_kept


def test_start_up_done_freezes_what_was_made_and_restores_the_thresholds(thresholds_kept):
    gc.unfreeze()
    with start_up():
        made = [[index] for index in range(10_000)]
        start_up_done()
        assert gc.get_threshold() == thresholds_kept
        assert gc.get_freeze_count() >= len(made)
        gc.set_threshold(5_000, 20, 20)  # changed after start-up: leaving must not undo it
    assert gc.get_threshold() == (5_000, 20, 20)


def test_a_background_import_freezes_what_it_made():
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    import_in_background("json").join()
    assert gc.get_freeze_count() > 0


def test_the_command_line_leaves_the_thresholds_as_it_found_them(tmp_path, thresholds_kept):
    code = tinyllm.main(["--train", "--config", str(tmp_path / "missing.toml")])
    assert code == 2
    assert gc.get_threshold() == thresholds_kept
