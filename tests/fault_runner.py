"""Run `tinyllm.main` in this process and send it a real signal at a chosen moment.

    python tests/fault_runner.py WHEN SIGNAL [COUNT] -- tinyllm arguments...

WHEN is `eval` (as the first evaluation starts), `save` (as the first checkpoint save
starts) or `step:N` (as the batch of step N is drawn); SIGNAL is SIGINT or SIGTERM; COUNT
(default 1) signals are sent back to back. The signal is delivered by the kernel to this
process like a Ctrl-C or a scheduler's SIGTERM; only the moment is chosen here, by wrapping
the function named, so the fault tests can hit an evaluation, a save or the last step on
purpose instead of by luck.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def arm(when: str, signum: int, count: int) -> None:
    from model.rundir.checkpoints import Checkpoints
    from model.training.trainer import Trainer

    fired = []

    def fire() -> None:
        if not fired:
            fired.append(True)
            for _ in range(count):
                os.kill(os.getpid(), signum)

    if when == "eval":
        original = Trainer.evaluate

        def evaluate(self, *args):
            fire()
            return original(self, *args)

        Trainer.evaluate = evaluate
    elif when == "save":
        original_save = Checkpoints.save

        def save(self, *args, **kwargs):
            fire()
            return original_save(self, *args, **kwargs)

        Checkpoints.save = save
    elif when.startswith("step:"):
        target = int(when.split(":")[1])
        original_batch = Trainer.batch

        def batch(self, tokens, step, stream=0, rows=None):
            if stream == 0 and step == target:
                fire()
            return original_batch(self, tokens, step, stream, rows)

        Trainer.batch = batch
    else:
        raise SystemExit(f"fault_runner: unknown moment {when!r}")


def main() -> int:
    args = sys.argv[1:]
    split = args.index("--")
    head, argv = args[:split], args[split + 1 :]
    when, signame = head[0], head[1]
    count = int(head[2]) if len(head) > 2 else 1
    arm(when, getattr(signal, signame), count)
    import tinyllm

    return tinyllm.main(argv)


if __name__ == "__main__":
    sys.exit(main())
