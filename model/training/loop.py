"""The training loop: steps, logging, evaluation, checkpoints, and stopping on a signal.

The loop runs train.steps_per_call steps a call (TrainConfig.steps_in_call: never past a
step where it logs, evaluates or saves). It never waits on the device except when it logs
(metrics are fetched one call late, so the next call is already dispatched), evaluates or
checkpoints. SIGINT and SIGTERM are
requests to stop (plumbing.signals): the loop finishes the step (and an evaluation under
way), saves a checkpoint unless this step is saved already, and raises `Stopped` (exit 130 /
143). A step is never saved twice. A NaN or infinite loss raises `TrainingDiverged` before
anything is saved, so the last good checkpoint stays the newest.

The loop owns the training state: it starts from the one it is given (made by the trainer)
and replaces it only with what the compiled step returns.

    >>> loop = TrainingLoop(trainer, trainer.initial_state(), splits, checkpoints, run_dir,
    ...                     meta)                                        # doctest: +SKIP
    >>> loop.run()["val_loss"]                                          # doctest: +SKIP
    2.4
"""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax

from model.accelerators.devices import peak_flops
from model.network.gpt import flops_per_token
from model.processes.distributed import is_primary, stop_agreed
from model.rundir.checkpoints import Checkpoints
from model.rundir.checkpoints import import_soon as checkpoints_import_soon
from model.training.data import TokenSplits
from model.training.errors import TrainingDiverged
from model.training.metrics import (
    MetricsLog,
    bits_per_byte,
    import_plotting_soon,
    plot_losses,
)
from model.training.tracking import open_tracker
from model.training.trainer import Trainer, TrainState
from plumbing.collector import start_up_done
from plumbing.progress import ProgressBar
from plumbing.signals import Stopped, StopRequests


@dataclass
class LoopState:
    """What the loop carries from one step to the next."""

    step: int  # steps trained so far
    saved_step: int | None  # the newest step on disk (a resumed run's first step is)
    rate_since: tuple[float, int]  # (time, step) the next tokens/s figure is measured from
    pending: tuple[int, dict] | None = None  # (step, metrics still on the device)
    record: dict = field(default_factory=dict)  # the newest logged train (and eval) values
    # Seconds spent apart from stepping: the first step (tracing and compiling it, or reading
    # it from the compilation cache), evaluations, checkpoints, the loss plot.
    spent: dict[str, float] = field(default_factory=dict)
    trained: int = 0  # steps this process trained (a resumed run's from its start)
    first_call_steps: int = 1  # steps the first call ran (train.steps_per_call)

    def timed(self, what: str, since: float) -> None:
        """Add the time from `since` until now to `spent[what]`."""
        self.spent[what] = self.spent.get(what, 0.0) + time.perf_counter() - since


def check_finite(step: int, metrics: dict) -> dict[str, float]:
    """The step's metrics as floats; TrainingDiverged naming the first that is not finite
    (the loss, else e.g. grad_norm or an auxiliary loss, whose weight may be the cause)."""
    values = {k: float(v) for k, v in metrics.items()}
    bad = [k for k, v in values.items() if not math.isfinite(v)]
    if bad:
        name = "loss" if "loss" in bad else bad[0]
        what = "the loss" if name == "loss" else f"{name} (the loss is {values['loss']:.4g})"
        raise TrainingDiverged(
            f"{what} became {values[name]} at step {step}: training stopped; the last good "
            "checkpoint is kept (lower train.learning_rate or raise train.warmup_steps"
            + ("" if name == "loss" else f", or the weight of what {name} measures")
            + ")"
        )
    return values


class TrainingLoop:
    """Runs `trainer`'s step from `state` (its step or 0) to train.max_steps; `meta`
    (resolved config, tokenizer hash, corpus fingerprint) goes with each checkpoint."""

    def __init__(
        self,
        trainer: Trainer,
        state: TrainState,
        splits: TokenSplits,
        checkpoints: Checkpoints,
        run_dir: Path,
        meta: dict,
        started: float | None = None,
    ) -> None:
        self.trainer, self.splits, self.checkpoints = trainer, splits, checkpoints
        # The newest state: only `_train` replaces it, with what the step returns (the step
        # donates the one it takes). Steps are counted on the host, in LoopState.step.
        self.train_state = state
        start_step = state.steps_taken()
        self.cfg = trainer.train_cfg
        self.run_dir, self.meta = Path(run_dir), meta
        self.block_size = trainer.model_cfg.block_size
        self.flops_per_token = flops_per_token(trainer.model_cfg, trainer.n_params)
        self.peak = peak_flops(jax.local_devices()[0].device_kind)
        resume_step = start_step or None
        tracker = open_tracker(self.cfg.tracker, self.run_dir, meta["config"], resume_step)
        self.log = MetricsLog(self.run_dir, resume_step, tracker)
        self.bar = ProgressBar(self.cfg.max_steps, "train", start=start_step)
        self.t0 = time.perf_counter()
        # The process's time before this loop (imports, data, the model), when the caller
        # knows when the process started (time.perf_counter() then).
        self.startup = None if started is None else self.t0 - started
        self.state = LoopState(start_step, start_step or None, (self.t0, start_step))
        checkpoints_import_soon()  # for the first save: every process saves
        if is_primary():  # the process that plots
            import_plotting_soon()

    def run(self) -> dict:
        """Train to the end (or to a stop); returns the last logged record."""
        start_up_done()  # the collector leaves start-up's objects alone from here
        with StopRequests() as stop:
            try:
                stopped_early = self._train(stop)
                if stopped_early or stop.requested is not None:
                    self._stop(stop)
                # The loss plot draws while orbax writes the last checkpoint.
                plotting = Plotting(self.run_dir)
                since = time.perf_counter()
                with stop.critical():
                    self.checkpoints.wait()
                self.state.timed("checkpoints", since)
            except TrainingDiverged as err:
                if self.state.saved_step is None:
                    raise TrainingDiverged(
                        str(err).split(": training stopped")[0]
                        + ": training stopped; no checkpoint had been saved yet (lower "
                        "train.learning_rate or raise train.warmup_steps)"
                    ) from None
                raise
            finally:
                self.log.close()
        return self._finish(plotting)

    def _train(self, stop: StopRequests) -> bool:
        """Step until train.max_steps; True when every process agreed to stop before it."""
        t, s, trainer = self.cfg, self.state, self.trainer
        while s.step < t.max_steps:
            # With several processes all stop at the same step: a signal may reach only one of
            # them, and the checkpoint that follows is collective.
            if stop_agreed(stop.requested is not None, s.step, t.log_interval):
                return True
            n = t.steps_in_call(s.step)
            since = time.perf_counter()
            if n > 1:  # train.steps_per_call steps in one call
                batches = trainer.batches(self.splits.train, s.step, n)
                self.train_state, metrics = trainer.train_steps(self.train_state, *batches)
            else:
                x, y = trainer.batch(self.splits.train, s.step)
                self.train_state, metrics = trainer.train_step(self.train_state, x, y)
            first = "first step" not in s.spent
            if first:  # jit compiles before it dispatches: wait for it
                jax.block_until_ready(metrics)
                s.timed("first step", since)
                s.first_call_steps = n
            s.step += n
            s.trained += n
            if first and s.step % t.log_interval and s.step != t.max_steps:
                s.rate_since = (time.perf_counter(), s.step)  # compiling is not throughput
            self._flush()  # the previous log step's metrics: ready by now, this hardly waits
            if s.step % t.log_interval == 0 or s.step == t.max_steps:
                s.pending = (s.step, metrics)
            is_eval = s.step % t.eval_interval == 0 or s.step == t.max_steps
            if is_eval or s.step % t.checkpoint_every == 0:
                self._flush()  # the NaN check, before anything is saved
                if s.record.get("step") != s.step:  # not a logged step: check its metrics too
                    check_finite(s.step, jax.device_get(metrics))
                if is_eval:
                    since = time.perf_counter()
                    self._evaluate()
                    s.timed("evaluation", since)
                since = time.perf_counter()
                self._save(stop)
                s.timed("checkpoints", since)
                # nor is saving: the tokens/s clock stands still while it runs
                s.rate_since = (s.rate_since[0] + time.perf_counter() - since, s.rate_since[1])
        return False

    def _flush(self) -> None:
        """Fetch, check and log the pending step's metrics."""
        if self.state.pending is None:
            return
        record = self._train_record(*self.state.pending)
        self.state.pending, self.state.record = None, record
        self.log.write(record)
        status = f"loss {record['train_loss']:.4f} {record['tokens_per_sec']:,.0f} tok/s"
        self.bar.advance_to(record["step"], status)

    def _train_record(self, step: int, metrics: dict) -> dict:
        values = check_finite(step, jax.device_get(metrics))
        now = time.perf_counter()
        since_time, since_step = self.state.rate_since
        # The steps' real batches (train.batch_size_schedule's sizes), not the full one.
        t = self.cfg
        tokens = (t.sequences_before(step) - t.sequences_before(since_step)) * self.block_size
        tok_s = tokens / max(now - since_time, 1e-9)
        self.state.rate_since = (now, step)
        record = {
            "step": step,
            "train_loss": values.pop("loss"),
            "tokens_per_sec": round(tok_s, 1),
            "elapsed_s": round(now - self.t0, 3),
            **values,
        }
        if t.batch_size_schedule:  # the logged step's batch and the tokens trained on so far
            record["batch_size"] = t.batch_size_at(step - 1)
            record["tokens"] = t.sequences_before(step) * self.block_size
        if self.peak:
            flops_s = tok_s * self.flops_per_token
            record["mfu"] = round(flops_s / self.peak / jax.device_count(), 4)
        return record

    def _evaluate(self) -> None:
        step = self.state.step
        val_loss = self.trainer.evaluate(self.train_state.params, self.splits)
        if not math.isfinite(val_loss):
            raise TrainingDiverged(
                f"the validation loss became {val_loss} at step {step}: training stopped; the "
                "last good checkpoint is kept"
            )
        record = {
            "step": step,
            "val_loss": val_loss,
            "val_bpb": bits_per_byte(val_loss, self.splits.val_bytes_per_token),
            "elapsed_s": round(time.perf_counter() - self.t0, 3),
        }
        self.log.write(record)
        self.bar.message(f"step {step}: val loss {val_loss:.4f}, val bpb {record['val_bpb']:.4f}")
        self.state.record.update(record)
        # Evaluation is not training throughput: the next figure's clock starts now.
        self.state.rate_since = (time.perf_counter(), self.state.rate_since[1])

    def _save(self, stop: StopRequests) -> None:
        s = self.state
        if s.saved_step == s.step:
            return
        with stop.critical():
            state, meta = self.train_state, {**self.meta, "step": s.step}
            self.checkpoints.save(s.step, state.params, state.opt_state, meta)
        s.saved_step = s.step

    def _stop(self, stop: StopRequests) -> None:
        """Save where the loop stands and raise `Stopped`, naming the signal and what was kept."""
        self._flush()
        self._save(stop)
        with stop.critical():
            self.checkpoints.wait()
        signum = stop.requested or signal.SIGINT  # another process's signal
        step = self.state.step
        if self.state.saved_step is None:
            kept = "no step was trained, nothing saved"
        else:
            more = "; --resume continues" if step < self.cfg.max_steps else " (the last step)"
            kept = f"saved a checkpoint at step {step}{more}"
        raise Stopped(signum, f"interrupted by {signal.Signals(signum).name}: {kept}")

    def _finish(self, plotting: Plotting) -> dict:
        since = time.perf_counter()
        plot = plotting.result()  # what the plot took beyond the checkpoint's wait
        self.state.timed("loss plot", since)
        record, step, trained = self.state.record, self.state.step, self.state.trained
        # A resumed run names the steps this call trained, not the run's whole count.
        steps = f"{step} steps" if trained == step else f"steps {step - trained + 1}-{step}"
        self.bar.message(
            f"train: done, {steps} in {time.perf_counter() - self.t0:.1f} s; "
            f"final val loss {record.get('val_loss', math.nan):.4f}, val bpb "
            f"{record.get('val_bpb', math.nan):.4f}" + (f"; loss curve {plot}" if plot else "")
        )
        self.bar.message(f"train: time spent: {self._time_spent()}")
        return record

    def _time_spent(self) -> str:
        """Where the process's time went: start-up, the first step (compiling it), the other
        steps, evaluation, checkpoints, the plot; then the fixed costs, all but the steps.

        >>> loop = TrainingLoop.__new__(TrainingLoop)
        >>> loop.t0, loop.state = time.perf_counter() - 10, LoopState(0, None, (0, 0))
        >>> loop.startup, loop.state.spent = 1.5, {"first step": 1.0, "evaluation": 2.0}
        >>> loop._time_spent()
        'start-up 1.5 s, first step 1.0 s, other steps 7.0 s, evaluation 2.0 s; fixed costs 4.5 s'
        >>> loop.state.trained, loop.state.first_call_steps = 38, 3  # the first call ran 3 steps
        >>> loop._time_spent()  # 7 s for the 35 later steps: 0.2 s each, 2 in the first call
        'start-up 1.5 s, first step 0.6 s, other steps 7.4 s, evaluation 2.0 s; fixed costs 4.1 s'
        """
        spent = dict(self.state.spent)
        steps = time.perf_counter() - self.t0 - sum(spent.values())
        first, later = self.state.first_call_steps, self.state.trained - self.state.first_call_steps
        if first > 1 and later > 0 and "first step" in spent:
            # The first call ran several steps: those beyond one, at the later calls' pace,
            # count as steps, not as the program's preparation.
            share = min(spent["first step"], (first - 1) * steps / later)
            spent["first step"] -= share
            steps += share
        parts = [] if self.startup is None else [("start-up", self.startup)]
        parts += [("first step", spent.get("first step", 0.0)), ("other steps", steps)]
        parts += [(k, v) for k, v in spent.items() if k != "first step"]
        fixed = sum(seconds for name, seconds in parts if name != "other steps")
        listed = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in parts)
        return f"{listed}; fixed costs {fixed:.1f} s"


class Plotting:
    """plot_losses(run_dir) on a thread of its own; `result()` waits for its path (or None),
    and raises what it raised."""

    def __init__(self, run_dir: Path) -> None:
        self._result: list = []
        self._thread = threading.Thread(target=self._plot, args=(run_dir,), name="loss-plot")
        self._thread.start()

    def _plot(self, run_dir: Path) -> None:
        try:
            self._result.append(plot_losses(run_dir))
        except BaseException as err:  # handed to the caller of result()
            self._result.append(err)

    def result(self) -> Path | None:
        self._thread.join()
        if isinstance(self._result[0], BaseException):
            raise self._result[0]
        return self._result[0]
