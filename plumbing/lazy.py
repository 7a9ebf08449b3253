"""Loading late or aside: package exports loaded on first use, so that importing one light
submodule of a package (a config section, say) does not pull in the heavy ones (JAX, numpy,
the C core); and heavy imports started on a background thread at the lowest priority, so that
they are done by the time they are needed without taking a busy machine's time.

    >>> __getattr__ = exports_on_first_use("json", {"dumps": "json"})  # in a package __init__
    >>> __getattr__("dumps")([1])
    '[1]'
    >>> import_in_background("json").join()
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from plumbing.collector import freeze_made_so_far


def exports_on_first_use(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `exports[name]` (a module path) when `name` is
    first asked for, and gives that module's attribute of the same name."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__


def in_background(name: str, work: Callable[[], object]) -> threading.Thread:
    """Run `work` on a daemon thread named `name`, at the lowest priority on Linux (nice 19, the
    thread's own; elsewhere a thread id is no process id). On a machine whose every core runs
    a device, its CPU then fills the devices' idle moments instead of taking their time:
    measured on 2 cores, the 60 training steps that matplotlib's import (0.55 s of CPU)
    overlapped took 73.5 ms a step at normal priority, 59.6 ms at nice 19, 63.6 ms with no
    import."""

    def run():
        if sys.platform == "linux":
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        work()
        freeze_made_so_far()  # what an import made is no garbage (plumbing/collector.py)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def import_in_background(module: str) -> threading.Thread:
    """Import `module` `in_background`; a later `import` of it waits for this one under
    Python's import lock. A missing package is left to that later import to report."""

    def load():
        with contextlib.suppress(ImportError):
            importlib.import_module(module)

    return in_background(f"import-{module}", load)
