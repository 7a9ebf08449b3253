"""A few train steps on however many devices JAX sees; run as a script under XLA_FLAGS.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/multidevice_run.py \
        CONFIG RUN_DIR '["key=value", ...]'

prints one JSON line: device count, per-step losses for data-parallel and FSDP training, how
the last batch was laid out over the devices, and for FSDP how the optimizer state is laid
out and how often JAX compiled the train step, on the fresh run and after a restore.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class CompileCounter:
    """How many times JAX compiled each function (its backend-compile events, by name)."""

    def __init__(self):
        import jax
        from jax._src import dispatch

        self.counts: dict[str, int] = {}
        event_name = dispatch.BACKEND_COMPILE_EVENT

        def listener(event, duration, **kwargs):
            if event == event_name:
                name = kwargs.get("fun_name", "")
                self.counts[name] = self.counts.get(name, 0) + 1

        jax.monitoring.register_event_duration_secs_listener(listener)

    def of(self, name: str) -> int:
        return self.counts.get(f"jit({name})", 0) + self.counts.get(name, 0)


def optimizer_layout(state) -> dict:
    """For every optimizer-state leaf shaped as its parameter (same path tail, same shape, 2+
    dimensions): whether it is laid out as the parameter, and how many such leaves are
    sharded. Smaller state (step counts, Polar Express's coefficients, NorMuon's moment per
    output neuron) is replicated."""
    import jax

    from model.network.params import path_names

    params = {path_names(p): x for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
    leaves, alike, sharded = 0, 0, 0
    for path, x in jax.tree_util.tree_leaves_with_path(state.opt_state):
        names = path_names(path)
        match = next((params[names[i:]] for i in range(len(names)) if names[i:] in params), None)
        if x.ndim < 2 or match is None or match.shape != x.shape:
            continue
        leaves += 1
        alike += match.sharding == x.sharding
        sharded += len({str(s.index) for s in x.addressable_shards}) > 1
    return {"leaves": leaves, "alike": alike, "sharded": sharded}


def train_steps(trainer, tokens, steps: range, state=None) -> tuple:
    """(the state after `steps`, their losses), from `state` or the trainer's initial one."""
    state = trainer.initial_state() if state is None else state
    losses = []
    for step in steps:
        x, y = trainer.batch(tokens, step)
        state, metrics = trainer.train_step(state, x, y)
        losses.append(float(metrics["loss"]))
    return state, losses


def short_run(
    config: str, run_dir: str, overrides: list[str], steps: int = 6, resume: bool = False
) -> dict:
    import jax

    from configs.schema import load_config
    from model.rundir.checkpoints import Checkpoints
    from model.training.data import load_token_splits
    from model.training.trainer import Trainer
    from tokenizer import load_tokenizer
    from tokenizer.corpus import corpus_for

    counter = CompileCounter()
    out: dict = {"devices": jax.device_count()}
    tok_path = Path(run_dir) / "tokenizer.pkl"
    tok = load_tokenizer(tok_path)
    for fsdp in (False, True):
        cfg = load_config(config, [*overrides, f"train.fsdp={str(fsdp).lower()}"])
        splits = load_token_splits(corpus_for(cfg.data), tok, tok_path, Path(run_dir), 0.1)
        model_cfg = cfg.model.for_vocab(tok.vocab_size)
        trainer = Trainer(cfg.train, model_cfg)
        before = counter.of("step")
        state, losses = train_steps(trainer, splits.train, range(steps))
        out["fsdp" if fsdp else "data_parallel"] = losses
        kernel = jax.tree_util.tree_leaves(state.params)[0]
        out["fsdp_param_shards" if fsdp else "dp_param_shards"] = len(
            {str(s.index) for s in kernel.addressable_shards}
        )
        if fsdp and resume:
            out["fsdp_step_compiles"] = counter.of("step") - before
            out["fsdp_optimizer"] = optimizer_layout(state)
            # --resume's path: a new trainer restores a checkpoint into its own layout, and
            # continues as the first one does.
            checkpoints = Checkpoints(Path(run_dir) / f"fsdp-{jax.device_count()}")
            checkpoints.save(steps, state.params, state.opt_state, {"config": {}})
            checkpoints.wait()
            more = range(steps, steps + 2)
            out["continued"] = train_steps(trainer, splits.train, more, state)[1]
            resumed = Trainer(cfg.train, model_cfg)
            restored = resumed.restored(checkpoints, steps)
            checkpoints.close()
            before = counter.of("step")
            restored, out["resumed"] = train_steps(resumed, splits.train, more, restored)
            out["resumed_step_compiles"] = counter.of("step") - before
            out["resumed_optimizer"] = optimizer_layout(restored)
    out["batch_shards"] = sorted({str(s.index) for s in x_shards(trainer, splits)})
    out["batch_shard_rows"] = [s.data.shape[1] for s in x_shards(trainer, splits)]
    return out


def x_shards(trainer, splits):
    return trainer.batch(splits.train, 0)[0].addressable_shards


if __name__ == "__main__":
    from model.processes.compilation_cache import enable_compilation_cache

    # As --train does: the fresh and the resumed trainer compile the same step (counted as
    # compiles all the same: JAX reports a disk-cache hit as a compilation of its own).
    enable_compilation_cache()
    print(json.dumps(short_run(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), resume=True)))
