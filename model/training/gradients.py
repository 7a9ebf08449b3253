"""The training step's gradients: summed over micro-batches, averaged over the mesh's devices.

With replicated parameters (plain data parallelism) XLA's partitioner sums each parameter's
gradient over the devices right where its product is computed, then combines the sums into
one all-reduce of every gradient, one operand each. XLA:CPU runs such an all-reduce one
operand at a time, a rendezvous of the devices for each: about 40 for a 4-layer model. Where
the objective is a mean over sequences and nothing else (no dropout, no batch statistics
such as an MoE router's balance loss), each device can instead take the gradient of its own
rows (`jax.shard_map`) and one all-reduce of all the gradients laid end to end gives their
mean: the same values to float rounding (tests/test_gradients.py compares them) in one
rendezvous. With sharded parameters (FSDP), dropout or MoE the partitioner's reduction stays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P


def accumulated(grad_fn, params, x_AxBxT, y_AxBxT, key):
    """The mean gradient of `grad_fn` (jax.value_and_grad of the objective, with its
    (cross-entropy, aux) beside the loss) over the A micro-batches, and each one's
    cross-entropy [A] and aux entries [A]. Micro-batch i draws its randomness from
    fold_in(key, i)."""
    n_micro = x_AxBxT.shape[0]
    if n_micro == 1:  # no accumulation: a scan of one would only cost XLA fusions
        (_, (ce, aux)), grads = grad_fn(params, x_AxBxT[0], y_AxBxT[0], jax.random.fold_in(key, 0))
        return grads, ce[None], {k: v[None] for k, v in aux.items()}

    def micro(grads_acc, inputs):
        x, y, i = inputs
        (_, (ce, aux)), grads = grad_fn(params, x, y, jax.random.fold_in(key, i))
        return jax.tree_util.tree_map(jnp.add, grads_acc, grads), (ce, aux)

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    grads, (ce, aux) = jax.lax.scan(micro, zeros, (x_AxBxT, y_AxBxT, jnp.arange(n_micro)))
    return jax.tree_util.tree_map(lambda g: g / n_micro, grads), ce, aux


def reduced_once(grad_fn, mesh):
    """`accumulated` on a 1-D data mesh of several devices with replicated parameters, each
    device on its own rows, the gradients averaged by one all-reduce of one flat vector.
    Only for an objective that is a plain mean over sequences (see the module docstring)."""
    (axis,) = mesh.axis_names

    def local(params, x_AxBxT, y_AxBxT, key):
        grads, ce, aux = accumulated(grad_fn, params, x_AxBxT, y_AxBxT, key)
        flat, unflatten = ravel_pytree(grads)
        grads = unflatten(jax.lax.pmean(flat, axis))
        return grads, jax.lax.pmean(ce, axis), jax.lax.pmean(aux, axis)

    # The pmeans make every output the same on every device, which check_vma would otherwise
    # answer by inserting a reduction per gradient in the transpose: the very thing avoided.
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(None, axis), P(None, axis), P()),
        out_specs=(P(), P(), P()),
        check_vma=False,
    )


def on_cpu_reduced_once(grad_fn, mesh, otherwise):
    """`reduced_once` where the program runs on CPUs, `otherwise` (the partitioner's
    reductions, which GPUs and TPUs overlap with the backward pass) elsewhere: chosen when the
    program is lowered, so a program lowered for cuda or tpu is the one those would run."""
    once = reduced_once(grad_fn, mesh)

    def gradients(*args):
        return jax.lax.platform_dependent(*args, cpu=once, default=otherwise)

    return gradients


def one_reduction_fits(model_cfg, train_cfg, mesh) -> bool:
    """Whether `reduced_once` gives the step's gradient: several devices holding replicated
    parameters (not FSDP), no dropout (its masks are drawn for the whole batch) and no MoE
    (the router's balance and z-losses are statistics of the whole batch)."""
    return (
        mesh.devices.size > 1
        and not train_cfg.fsdp
        and model_cfg.dropout == 0
        and model_cfg.moe_experts == 0
    )
