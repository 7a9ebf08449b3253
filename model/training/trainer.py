"""The model and optimizer state on the device mesh, the compiled train step, evaluation.

One jitted step (donated params and optimizer state, gradient accumulation as a scan over
micro-batches) runs on a 1-D `data` mesh (model/processes/mesh.py). Everything random is a
function of (seed, step), so a resumed run replays the uninterrupted one.

    >>> from model.network.config import ModelConfig
    >>> from model.training.config import TrainConfig
    >>> cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    >>> trainer = Trainer(TrainConfig(batch_size=4), cfg)
    >>> x, y = trainer.batch(np.arange(200, dtype=np.uint16) % 64, step=0)
    >>> params, opt_state, metrics = trainer.train_step(trainer.params, trainer.opt_state, x, y, 0)
    >>> sorted(metrics)
    ['grad_norm', 'loss']
"""

from __future__ import annotations

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
from model.quantization.kernels import fake_quant_tree
from model.training.config import TrainConfig
from model.training.data import TokenSplits, sample_batch
from model.training.optim import make_optimizer
from plumbing.errors import UsageError


def evaluate_windows(model: GPT, tokens: np.ndarray, rows: int = 64) -> float:
    """Mean loss of `model` over every non-overlapping block_size window of `tokens`, in order.

    Deterministic and exact where `Trainer.evaluate` samples `eval_steps` random batches (as
    nanoGPT's estimate_loss does): for comparing runs whose sampled figures differ by noise.
    """
    t = model.cfg.block_size
    starts = np.arange(0, len(tokens) - t, t)
    if len(starts) == 0:
        raise UsageError(f"{len(tokens)} tokens hold no window of {t} + 1")
    graphdef, state = nnx.split(model)

    @jax.jit
    def window_loss(state, x_BxT, y_BxT):
        return cross_entropy(nnx.merge(graphdef, state)(x_BxT), y_BxT)

    total = 0.0
    for i in range(0, len(starts), rows):
        windows = np.stack([tokens[o : o + t + 1] for o in starts[i : i + rows]])
        x, y = (jnp.asarray(a, jnp.int32) for a in (windows[:, :-1], windows[:, 1:]))
        total += float(window_loss(state, x, y)) * len(windows)
    return total / len(starts)


def initial_state(model_cfg: ModelConfig, seed: int):
    """(graphdef, params, rest) of a freshly initialised GPT, its initialisers run as one
    compiled program: run one by one, each would compile a program of its own (most of a
    small model's start-up), and as one the persistent compilation cache keeps it. The
    random draws are the eager ones (jax.random is the same under jit), the values equal to
    float rounding."""

    def build():
        return nnx.split(GPT(model_cfg, rngs=nnx.Rngs(params=seed)), nnx.Param, ...)

    abstract = nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(params=seed)))
    graphdef = nnx.split(abstract, nnx.Param, ...)[0]
    params, rest = jax.jit(lambda: build()[1:])()
    return graphdef, params, rest


def forward_weights(params, train_cfg: TrainConfig):
    """The weights the forward pass uses: under QAT, linear kernels fake-quantized with a
    straight-through estimator (gradients reach the float params unchanged)."""
    t = train_cfg
    return fake_quant_tree(params, t.qat_bits, t.quant_group_size) if t.qat_bits else params


def training_loss(graphdef, rest, train_cfg: TrainConfig):
    """The objective `loss(params, x_BxT, y_BxT, key) -> (total, (cross-entropy, aux))` of the
    model `graphdef` (with its non-parameter state `rest`)."""

    def loss(params, x_BxT, y_BxT, key):
        model = nnx.merge(graphdef, forward_weights(params, train_cfg), rest)
        dropout = model.cfg.dropout > 0
        rngs = nnx.Rngs(dropout=key) if dropout else None
        logits, aux = model.forward_with_aux(x_BxT, deterministic=not dropout, rngs=rngs)
        ce = cross_entropy(logits, y_BxT)
        # Auxiliary entries named *_loss (MoE load balance, router z-loss) come already
        # weighted and join the objective; others (e.g. dropped-token counts) are only logged.
        total = ce + sum((v for k, v in aux.items() if k.endswith("_loss")), jnp.float32(0))
        return total, (ce, aux)

    return loss


class Trainer:
    """Model + optimizer state on the mesh, the compiled step, evaluation.

    With `abstract=True` nothing is allocated or initialised: params and optimizer state are
    ShapeDtypeStructs carrying the shardings a real run would give them, so the step and the
    evaluation can be traced, lowered for another platform (scripts/check_lowering.py) or
    compiled for XLA's memory analysis at any model size.
    """

    def __init__(self, train_cfg: TrainConfig, model_cfg: ModelConfig, *, abstract: bool = False):
        self.train_cfg, self.model_cfg = train_cfg, model_cfg
        t = train_cfg
        self.mesh = data_mesh()
        self.micro_batch = t.micro_batch
        check_batch_divisible(self.micro_batch, self.mesh)
        check_batch_divisible(t.eval_rows, self.mesh, "the validation batch (train.eval_batch_size")
        if abstract:
            self.graphdef, params, self.rest = abstract_model(model_cfg)
        else:
            self.graphdef, params, self.rest = initial_state(model_cfg, t.seed)
        self.n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
        self.tx = make_optimizer(t)
        # Parameters, gradients and optimizer moments are laid out alike (FSDP: all sharded),
        # the state born that way and kept that way by the step's out_shardings: the step's
        # outputs match its first inputs, so it compiles once.
        self.param_shardings = param_shardings(params, self.mesh, t.fsdp)
        opt_shapes = jax.eval_shape(self.tx.init, params)
        self.opt_shardings = shardings_like_params(
            opt_shapes, params, self.param_shardings, self.mesh
        )
        if abstract:
            self.params = _placed_shapes(params, self.param_shardings)
            self.opt_state = _placed_shapes(opt_shapes, self.opt_shardings)
        else:
            self.params = jax.device_put(params, self.param_shardings)
            self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)
        self.batch_sharding = batch_sharding(self.mesh)
        self._loss = training_loss(self.graphdef, self.rest, t)
        self.train_step = self._compile_step()
        self.eval_step = jax.jit(self._eval_loss)

    # -- the compiled functions ------------------------------------------------------------

    def _compile_step(self):
        seed = self.train_cfg.seed
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)

        def step(params, opt_state, x_AxBxT, y_AxBxT, step):
            key = jax.random.fold_in(jax.random.key(seed), step)

            def micro(grads_acc, inputs):
                x, y, i = inputs
                (_, (ce, aux)), grads = grad_fn(params, x, y, jax.random.fold_in(key, i))
                grads_acc = jax.tree_util.tree_map(jnp.add, grads_acc, grads)
                return grads_acc, (ce, aux)

            n_micro = x_AxBxT.shape[0]
            if n_micro == 1:  # no accumulation: a scan of one would only cost XLA fusions
                (_, (ce, aux)), grads = grad_fn(
                    params, x_AxBxT[0], y_AxBxT[0], jax.random.fold_in(key, 0)
                )
                ce, aux = ce[None], {k: v[None] for k, v in aux.items()}
            else:
                zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
                grads, (ce, aux) = jax.lax.scan(
                    micro, zeros, (x_AxBxT, y_AxBxT, jnp.arange(n_micro))
                )
                grads = jax.tree_util.tree_map(lambda g: g / n_micro, grads)
            # FSDP: each device keeps its shard of the gradients (a reduce-scatter).
            grads = jax.lax.with_sharding_constraint(grads, self.param_shardings)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            metrics = {"loss": ce.mean(), "grad_norm": optax.tree.norm(grads)}
            metrics.update({k: v.mean() for k, v in aux.items()})
            return params, opt_state, metrics

        # Donation lets XLA update params and Adam moments in place.
        replicated = NamedSharding(self.mesh, P())
        return jax.jit(
            step,
            donate_argnums=(0, 1),
            out_shardings=(self.param_shardings, self.opt_shardings, replicated),
        )

    def _eval_loss(self, params, x_BxT, y_BxT):
        model = nnx.merge(self.graphdef, forward_weights(params, self.train_cfg), self.rest)
        logits, _ = model.forward_with_aux(x_BxT, deterministic=True)
        return cross_entropy(logits, y_BxT)

    # -- host side -------------------------------------------------------------------------

    def batch(self, tokens: np.ndarray, step: int, stream: int = 0, rows: int | None = None):
        """Sequences of `step` on the mesh: the training batch as [grad_accum, micro, T], or
        with `rows`, [1, rows, T] (validation)."""
        shape = self._batch_shape(rows)
        t = self.train_cfg
        x, y = sample_batch(tokens, shape[0] * shape[1], shape[2], t.seed, step, stream)
        return (
            put_batch(x.reshape(shape), self.batch_sharding),
            put_batch(y.reshape(shape), self.batch_sharding),
        )

    def batch_shapes(self, rows: int | None = None) -> tuple:
        """`batch`'s (x, y) as ShapeDtypeStructs with their sharding, for tracing."""
        x = jax.ShapeDtypeStruct(self._batch_shape(rows), jnp.int32, sharding=self.batch_sharding)
        return x, x

    def _batch_shape(self, rows: int | None) -> tuple[int, int, int]:
        """[grad_accum, micro-batch, T] for training; [1, rows, T] for `rows` (validation)."""
        t, block = self.train_cfg, self.model_cfg.block_size
        return (t.grad_accum, t.micro_batch, block) if rows is None else (1, rows, block)

    def evaluate(self, splits: TokenSplits) -> float:
        """Mean validation loss over `eval_steps` fixed batches (the same at every eval)."""
        total = jnp.float32(0)
        for i in range(self.train_cfg.eval_steps):
            x, y = self.batch(splits.val, i, stream=1, rows=self.train_cfg.eval_rows)
            total = total + self.eval_step(self.params, x[0], y[0])
        return float(total) / self.train_cfg.eval_steps


def _placed_shapes(tree, shardings):
    """ShapeDtypeStructs of `tree`'s leaves, each with its sharding."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
