"""The training state, the compiled step that advances it, evaluation.

A `TrainState` (params, optimizer state, step, the run's key; state.py) is immutable, as
Levanter's TrainerState: the trainer makes the first one (`initial_state`: fresh, or from
given weights for --init-from; `restored`: a checkpoint's, for --resume) and the compiled step
`train_step(state, x, y) -> (next state, metrics)` makes every other, donating the one it
takes (its arrays are deleted: hold on to the returned state only); `train_steps(state, xs,
ys)` runs train.steps_per_call of them in one call, a loop on the devices over their stacked
batches (`batches`). Nothing else builds or writes one. The step (gradient accumulation as a
scan over micro-batches) runs on a 1-D `data` mesh (model/processes/mesh.py). Everything
random is a function of (seed, step), so a resumed run replays the uninterrupted one.

    >>> from model.network.config import ModelConfig
    >>> from model.training.config import TrainConfig
    >>> cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    >>> trainer = Trainer(TrainConfig(batch_size=4), cfg)
    >>> state = trainer.initial_state()
    >>> x, y = trainer.batch(np.arange(200, dtype=np.uint16) % 64, step=0)
    >>> state, metrics = trainer.train_step(state, x, y)
    >>> state.steps_taken(), sorted(metrics)
    (1, ['grad_norm', 'loss'])
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from model.network.config import ModelConfig
from model.network.gpt import GPT
from model.network.loss import cross_entropy  # the model's loss, used here and re-exported
from model.network.params import abstract_model
from model.processes.mesh import (
    batch_sharding,
    check_batch_divisible,
    data_mesh,
    param_shardings,
    put_batch,
    shardings_like_params,
)
from model.training.config import TrainConfig
from model.training.data import TokenSplits, sample_batch
from model.training.gradients import accumulated, on_cpu_reduced_once, one_reduction_fits
from model.training.kept_programs import (
    STEP_KIND,
    STEPS_KIND,
    KeptProgram,
    ReadAhead,
    kept,
    kept_value,
    training_arguments,
)
from model.training.objective import forward_weights, training_loss
from model.training.optim import make_optimizer
from model.training.state import TrainState

# The training key's generator, named rather than left to jax_default_prng_impl: seed_key
# builds its keys by hand.
KEY_IMPL = "threefry2x32"

if TYPE_CHECKING:
    from model.decoding.program_cache import ProgramCache


def init_params(model_cfg: ModelConfig, seed: int):
    """The parameters of a freshly initialised GPT (jit it: its initialisers then run as one
    compiled program; run one by one, each would compile a program of its own, most of a
    small model's start-up, and as one the persistent compilation cache keeps it). The
    random draws are the eager ones (jax.random is the same under jit), equal to float
    rounding."""
    return nnx.split(GPT(model_cfg, rngs=nnx.Rngs(params=seed)), nnx.Param, ...)[1]


class Trainer:
    """The shardings, the compiled step and evaluation of one run; makes its first state.

    With `abstract=True` nothing is allocated or initialised: `initial_state()` gives
    ShapeDtypeStructs carrying the shardings a real run would give them, so the step and the
    evaluation can be traced, lowered for another platform (scripts/check_lowering.py) or
    compiled for XLA's memory analysis at any model size. With `programs`, what it compiles
    is kept there for the next run of the config (model/training/kept_programs.py); `ahead`
    holds programs of it read before it was made (`read_ahead`).
    """

    def __init__(
        self,
        train_cfg: TrainConfig,
        model_cfg: ModelConfig,
        *,
        abstract: bool = False,
        programs: ProgramCache | None = None,
        ahead: ReadAhead | None = None,
    ):
        self.train_cfg, self.model_cfg, self.abstract = train_cfg, model_cfg, abstract
        t = train_cfg
        self.mesh = data_mesh()
        self.micro_batch = t.micro_batch
        check_batch_divisible(self.micro_batch, self.mesh)
        for size in t.batch_sizes:  # train.batch_size_schedule's, each its own program
            check_batch_divisible(
                size // t.grad_accum, self.mesh,
                f"train.batch_size_schedule's micro-batch ({size} / train.grad_accum",
            )  # fmt: skip
        check_batch_divisible(t.eval_rows, self.mesh, "the validation batch (train.eval_batch_size")
        self.graphdef, shapes, self.rest = abstract_model(model_cfg, programs)
        self.n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
        # Replicated parameters: the devices share Muon's orthogonalisation out.
        self.tx = make_optimizer(t, None if t.fsdp else self.mesh)
        # Parameters, gradients and optimizer moments are laid out alike (FSDP: all sharded),
        # the state born that way and kept that way by the step's out_shardings: the step's
        # outputs match its first inputs, so it compiles once.
        self.param_shardings = param_shardings(shapes, self.mesh, t.fsdp)
        opt_shapes = jax.eval_shape(self.tx.init, shapes)
        self.opt_shardings = shardings_like_params(
            opt_shapes, shapes, self.param_shardings, self.mesh
        )
        self.replicated = replicated = NamedSharding(self.mesh, P())  # scalars: step, key, sums
        self.state_shardings = TrainState(
            self.param_shardings, self.opt_shardings, replicated, replicated
        )
        key_shape = jax.eval_shape(lambda: jax.random.key(0, impl=KEY_IMPL))
        self._state_shapes = _placed_shapes(
            TrainState(shapes, opt_shapes, jax.ShapeDtypeStruct((), jnp.int32), key_shape),
            self.state_shardings,
        )
        # Kept programs: no tracing, lowering or compiling in the next run of this config.
        run = training_arguments(t, model_cfg)
        mesh_devices = list(self.mesh.devices.flat)

        def keep(jitted, kind: str):
            return kept(jitted, programs, kind, run, mesh_devices, ahead)

        self._init_params = keep(
            jax.jit(
                functools.partial(init_params, model_cfg, t.seed),
                out_shardings=self.param_shardings,
            ),
            "train-init-params",
        )
        self._kept_params = kept_value(programs, "train-initial-params", run, mesh_devices)
        self._init_opt_state = keep(
            jax.jit(self.tx.init, out_shardings=self.opt_shardings), "train-init-optimizer"
        )
        self.batch_sharding = batch_sharding(self.mesh)
        self._loss = training_loss(self.graphdef, self.rest, t)
        step = self._step_function()
        self.train_step = keep(self._compile_step(step), STEP_KIND)
        self.train_steps = keep(self._compile_steps(step), STEPS_KIND)  # train.steps_per_call
        self.steps_sharding = NamedSharding(self.mesh, P(None, *self.batch_sharding.spec))
        self.eval_step = jax.jit(self._eval_loss)
        # The running sum goes in and out replicated: one program for every chunk.
        self.eval_batches = keep(
            jax.jit(self._eval_losses_summed, out_shardings=replicated), "train-evaluation"
        )

    # -- the states it makes ---------------------------------------------------------------

    def initial_state(self, params=None) -> TrainState:
        """Step 0: `params` (--init-from's weights, placed on the mesh here) or freshly
        initialised ones from train.seed, and a fresh optimizer state. Abstract: the shapes."""
        if self.abstract:
            return self._state_shapes
        if params is None:
            params = self._fresh_params()
        else:
            params = jax.device_put(params, self.param_shardings)
        return self._state(params, self._init_opt_state(params), 0)

    def _fresh_params(self):
        """train.seed's initial parameters: read back where an earlier run of this config
        kept them (a few ms), else computed by the initialiser's program and kept."""
        kept = self._kept_params
        params = kept.get(self._state_shapes.params) if kept is not None else None
        if params is None:
            params = self._init_params()
            if kept is not None:
                kept.put(params)
        return params

    def restored(self, checkpoints, step: int) -> TrainState:
        """The state saved at `step` in `checkpoints` (model.rundir.checkpoints.Checkpoints),
        in this trainer's layout; CheckpointDamaged if it does not read back intact."""
        like = self._state_shapes
        params, opt_state, _ = checkpoints.restore(step, like.params, like.opt_state)
        return self._state(params, opt_state, step)

    def param_shapes(self):
        """The params as ShapeDtypeStructs with their shardings (what loading weights from
        elsewhere shapes and places them like)."""
        return self._state_shapes.params

    def _state(self, params, opt_state, step: int) -> TrainState:
        step_on_mesh = put_batch(np.asarray(step, np.int32), self.state_shardings.step)
        key = seed_key(self.train_cfg.seed, self.state_shardings.key)
        return TrainState(params, opt_state, step_on_mesh, key)

    def prefetch_programs(self, fresh: bool = False) -> None:
        """Start reading the kept programs (KeptProgram.prefetch) while the caller reads the
        corpus and builds the first state, in the order they are needed: with `fresh` (a
        state initialised here) the initialisers, then the step for the first batch, then
        evaluation. Without kept programs this does nothing."""
        t, shapes = self.train_cfg, self._state_shapes
        x = self._batch_struct(self._batch_shape(None, 0))
        x_eval = self._batch_struct((self._eval_chunk(), t.eval_rows, self.model_cfg.block_size))
        total = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.replicated)
        params_kept = self._kept_params is not None and self._kept_params.kept()
        initialisers = [(self._init_opt_state, (shapes.params,))]
        if not params_kept:  # kept parameters need no initialiser's program
            initialisers.insert(0, (self._init_params, ()))
        for program, args in [
            *(initialisers if fresh else []),
            self._first_call(shapes, x),
            (self.eval_batches, (shapes.params, x_eval, x_eval, total)),
        ]:
            if isinstance(program, KeptProgram):
                program.prefetch(*args)

    def _first_call(self, shapes, x):
        """The program (and its arguments' shapes) of a fresh run's first training call."""
        n = self.train_cfg.steps_in_call(0)
        if n == 1:
            return self.train_step, (shapes, x, x)
        xs = self._stacked_struct(x, n)  # step 0's batch size (a schedule's first)
        return self.train_steps, (shapes, xs, xs)

    # -- the compiled functions ------------------------------------------------------------

    def _step_function(self):
        """The training step `step(state, x [A, B, T], y) -> (next state, metrics)`."""
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        gradients = functools.partial(accumulated, grad_fn)
        if one_reduction_fits(self.model_cfg, self.train_cfg, self.mesh):
            gradients = on_cpu_reduced_once(grad_fn, self.mesh, otherwise=gradients)

        def step(state: TrainState, x_AxBxT, y_AxBxT):
            params = state.params
            key = jax.random.fold_in(state.key, state.step)
            grads, ce, aux = gradients(params, x_AxBxT, y_AxBxT, key)
            # FSDP: each device keeps its shard of the gradients (a reduce-scatter).
            grads = jax.lax.with_sharding_constraint(grads, self.param_shardings)
            updates, opt_state = self.tx.update(grads, state.opt_state, params)
            params = optax.apply_updates(params, updates)
            metrics = {"loss": ce.mean(), "grad_norm": optax.tree.norm(grads)}
            metrics.update({k: v.mean() for k, v in aux.items()})
            return state.advanced(params, opt_state), metrics

        return step

    def _compile_step(self, step):
        # Donation lets XLA update params and Adam moments in place.
        return jax.jit(
            step, donate_argnums=0, out_shardings=(self.state_shardings, self.replicated)
        )

    def _compile_steps(self, step):
        """N steps in one program, `(state, x [N, A, B, T], y) -> (the state after them, the
        last one's metrics)`: a loop on the devices, one call from the host."""

        def steps(state: TrainState, x_NxAxBxT, y_NxAxBxT):
            state, metrics = jax.lax.scan(lambda s, xy: step(s, *xy), state, (x_NxAxBxT, y_NxAxBxT))
            return state, jax.tree_util.tree_map(lambda m: m[-1], metrics)

        return self._compile_step(steps)

    def _eval_loss(self, params, x_BxT, y_BxT):
        model = nnx.merge(self.graphdef, forward_weights(params, self.train_cfg), self.rest)
        logits, _ = model.forward_with_aux(x_BxT, deterministic=True)
        return cross_entropy(logits, y_BxT)

    # -- host side -------------------------------------------------------------------------

    def batch(self, tokens: np.ndarray, step: int, stream: int = 0, rows: int | None = None):
        """Sequences of `step` on the mesh: the training batch as [grad_accum, micro, T] (the
        step's size under train.batch_size_schedule), or with `rows`, [1, rows, T]
        (validation)."""
        x, y = self.host_batch(tokens, step, stream, rows)
        return put_batch(x, self.batch_sharding), put_batch(y, self.batch_sharding)

    def batches(self, tokens: np.ndarray, step: int, n: int):
        """The batches of steps step..step+n-1 stacked, [n, grad_accum, micro, T] on the mesh:
        `train_steps`' input."""
        xs, ys = zip(*(self.host_batch(tokens, s) for s in range(step, step + n)), strict=True)
        return tuple(put_batch(np.stack(a), self.steps_sharding) for a in (xs, ys))

    def host_batch(self, tokens: np.ndarray, step: int, stream: int = 0, rows: int | None = None):
        """`batch`'s (x, y) in host memory, before they go to the mesh."""
        shape = self._batch_shape(rows, step)
        t = self.train_cfg
        x, y = sample_batch(tokens, shape[0] * shape[1], shape[2], t.seed, step, stream)
        return x.reshape(shape), y.reshape(shape)

    def batch_shapes(self, rows: int | None = None, steps: int = 1) -> tuple:
        """`batch`'s (x, y) as ShapeDtypeStructs with their sharding, for tracing (training:
        the full train.batch_size, the largest program a batch-size schedule runs); with
        `steps` > 1, `batches`' for a call of that many steps."""
        x = self._batch_struct(self._batch_shape(rows))
        x = x if steps == 1 else self._stacked_struct(x, steps)
        return x, x

    def _stacked_struct(self, x: jax.ShapeDtypeStruct, steps: int) -> jax.ShapeDtypeStruct:
        """`steps` batches shaped as `x`, stacked and laid out as `batches` places them."""
        return jax.ShapeDtypeStruct((steps, *x.shape), x.dtype, sharding=self.steps_sharding)

    def _batch_struct(self, shape: tuple) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)

    def _eval_chunk(self) -> int:
        """Validation batches per evaluation program (eval_chunk)."""
        t = self.train_cfg
        return eval_chunk(t.eval_steps, t.eval_rows * self.model_cfg.block_size)

    def _batch_shape(self, rows: int | None, step: int | None = None) -> tuple[int, int, int]:
        """[grad_accum, micro-batch, T] for training (`step`'s batch size, or without a step
        the full one); [1, rows, T] for `rows` (validation)."""
        t, block = self.train_cfg, self.model_cfg.block_size
        if rows is not None:
            return (1, rows, block)
        size = t.batch_size if step is None else t.batch_size_at(step)
        return (t.grad_accum, size // t.grad_accum, block)

    def evaluate(self, params, splits: TokenSplits) -> float:
        """Mean validation loss of `params` (a state's) over `eval_steps` fixed batches (the
        same at every eval). The batches go to the device a chunk at a time and each chunk
        runs as one program: one call per batch cost a small model more in dispatch than in
        arithmetic. The losses add up in batch order, in float32, as one call per batch did."""
        t = self.train_cfg
        chunk = self._eval_chunk()
        total = put_batch(np.zeros((), np.float32), self.replicated)
        for start in range(0, t.eval_steps, chunk):
            pairs = [
                self.host_batch(splits.val, i, stream=1, rows=t.eval_rows)  # [1, rows, T] each
                for i in range(start, start + chunk)
            ]
            xs, ys = zip(*pairs, strict=True)
            x, y = (put_batch(np.concatenate(a), self.batch_sharding) for a in (xs, ys))
            total = self.eval_batches(params, x, y, total)
        return float(total) / t.eval_steps

    def _eval_losses_summed(self, params, x_SxBxT, y_SxBxT, total):
        """`total` plus the loss of each of the S batches, added in order."""

        def add(total, xy):
            return total + self._eval_loss(params, *xy), None

        return jax.lax.scan(add, total, (x_SxBxT, y_SxBxT))[0]


def seed_key(seed: int, sharding: NamedSharding) -> jax.Array:
    """`jax.random.key(seed, impl=KEY_IMPL)` placed with `sharding`, made on the host rather
    than by a jitted jax.random.key: a warm run then traces and compiles nothing (each small
    program costs it tens of milliseconds). threefry's key for a seed in 0..2**32-1 is the
    pair (0, seed); put_batch places it in every process's devices."""
    data = put_batch(np.array([0, seed], np.uint32), sharding)
    return jax.random.wrap_key_data(data, impl=KEY_IMPL)


def eval_chunk(eval_steps: int, tokens_per_batch: int, budget: int = 1 << 21) -> int:
    """Validation batches per program: the most that divide `eval_steps` (so one program
    serves every chunk) and hold at most `budget` tokens (a bounded host and device copy).

    >>> eval_chunk(200, 12 * 64), eval_chunk(200, 480 * 1024), eval_chunk(7, 10**7)
    (200, 4, 1)
    """
    fits = max(1, budget // max(tokens_per_batch, 1))
    return max(n for n in range(1, min(fits, eval_steps) + 1) if eval_steps % n == 0)


def _placed_shapes(tree, shardings):
    """ShapeDtypeStructs of `tree`'s leaves, each with its sharding."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
