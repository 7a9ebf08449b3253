"""A `tinyllm.py --serve` subprocess for tests: started on a free port, stopped with a signal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"serve: ready on (http://\S+)")


class ServerProcess:
    """`with ServerProcess(run_dir, "serve.batch_size=2") as server:` ... `server.url`.

    Its stderr is collected in `server.lines` (a thread reads it); on exit the server gets
    SIGINT, and SIGKILL if it is still there after 20 s.
    """

    def __init__(self, run_dir: Path, *args: str, env: dict | None = None) -> None:
        self.cmd = [sys.executable, str(ROOT / "tinyllm.py"), "--serve", "--out", str(run_dir)]
        self.cmd += ["--port", "0", *args]
        self.env = {**os.environ, **(env or {})}
        self.lines: list[str] = []
        self.url = ""

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 120
        while not self.url:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError("the server did not start:\n" + "\n".join(self.lines))
            time.sleep(0.05)
        return self

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            found = READY.search(line)
            if found:
                self.url = found.group(1)

    def stop(self, signum: int = signal.SIGINT, timeout_s: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        return self.wait(timeout_s)

    def wait(self, timeout_s: float = 20) -> int:
        """The exit code once the server ends by itself (after a signal already sent: a second
        one during its shutdown would change how it ends); SIGKILL after `timeout_s`."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode

    def __exit__(self, *exc) -> None:
        self.stop()
