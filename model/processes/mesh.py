"""Devices and shardings: a 1-D `data` mesh over every visible device.

Batches are sharded over `data`; parameters are replicated (data parallel) or, with
`train.fsdp`, sharded over the same axis along their first evenly divisible dimension
(ZeRO-3 style: XLA gathers them for each use). Mixture-of-experts weights stacked along a
leading expert axis are split along it whenever the device count divides the expert count
(expert parallelism: each device holds whole experts). With several processes
(model/processes/distributed.py) the mesh spans every process's devices and each process feeds
only the rows of the global batch that its own devices hold.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from model.network.moe import EXPERT_PARAM_PREFIX
from model.network.params import path_names
from plumbing.errors import UsageError


def data_mesh() -> Mesh:
    # Mesh(...) keeps Auto axis types (jax.make_mesh now defaults to Explicit, which would
    # need out_sharding annotations on every embedding lookup).
    return Mesh(np.array(jax.devices()), ("data",))


def check_batch_divisible(
    rows: int, mesh: Mesh, what: str = "the micro-batch (train.batch_size / train.grad_accum"
) -> None:
    """UsageError unless `rows` sequences split evenly over the mesh's devices."""
    n = mesh.devices.size
    if rows % n:
        raise UsageError(f"{what} = {rows}) must divide evenly over the {n} devices")


def sharded_axis(names: tuple[str, ...], shape: tuple[int, ...], n: int, fsdp: bool) -> int | None:
    """The axis a parameter (path `names`, `shape`) is split along over `n` devices; None:
    replicated. FSDP splits the first axis n divides, of a parameter of 2+ dimensions;
    expert-stacked MoE parameters ([E, ...], named expert_*) split along E whenever n > 1
    divides E (expert parallelism), with or without FSDP."""
    is_expert = any(name.startswith(EXPERT_PARAM_PREFIX) for name in names)
    if is_expert and n > 1 and shape[0] % n == 0:
        return 0
    if fsdp and len(shape) >= 2:
        return next((axis for axis, size in enumerate(shape) if size % n == 0), None)
    return None


def param_shardings(params, mesh: Mesh, fsdp: bool):
    """Each parameter's NamedSharding on the `data` axis, as `sharded_axis` says."""
    n = mesh.devices.size

    def spec(path, x) -> NamedSharding:
        axis = sharded_axis(path_names(path), x.shape, n, fsdp)
        if axis is None:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, P(*([None] * axis), "data"))

    return jax.tree_util.tree_map_with_path(spec, params)


def shardings_like_params(tree, params, shardings, mesh: Mesh):
    """Shardings for a tree that holds parameter-shaped leaves (optimizer moments): each such
    leaf sharded as its parameter (`owning_parameter`), everything else (step counts, schedule
    state) replicated. Without this, `jax.jit(tx.init)` returns the moments replicated (zeros
    depend on no sharded input), FSDP holds the whole Adam state on every device, and the step
    compiles again once it returns the state sharded."""
    by_path = {
        path_names(path): (tuple(x.shape), sharding)
        for (path, x), sharding in zip(
            jax.tree_util.tree_leaves_with_path(params),
            jax.tree_util.tree_leaves(shardings),
            strict=True,
        )
    }
    replicated = NamedSharding(mesh, P())

    def spec(path, x) -> NamedSharding:
        found = owning_parameter(path_names(path), tuple(x.shape), by_path)
        return replicated if found is None else found

    return jax.tree_util.tree_map_with_path(spec, tree)


def owning_parameter(names: tuple[str, ...], shape: tuple[int, ...], by_path: dict):
    """by_path[p][1] for the parameter p that a state leaf (path `names`, `shape`) belongs to,
    or None. by_path maps parameter paths to (shape, anything). A leaf belongs to a parameter
    when its path ends with the parameter's path and the shapes agree: optax nests moments
    under its own keys (`mu`, `nu`, muon's partition) but keeps each parameter's path below.

    >>> params = {("wte", "embedding"): ((4, 2), "x")}
    >>> owning_parameter(("0", "mu", "wte", "embedding"), (4, 2), params)
    'x'
    """
    for start in range(len(names)):  # the longest matching tail first
        found = by_path.get(names[start:])
        if found is not None and found[0] == shape:
            return found[1]
    return None


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are [grad_accum, micro_batch, T]: split the micro-batch rows over `data`."""
    return NamedSharding(mesh, P(None, "data"))


def put_batch(x_AxBxT: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """Place a global batch (the same numpy array in every process, drawn from the seed).

    With several processes each one copies only the slices its own devices hold, whatever
    the order of devices in the mesh and however many each process has.
    """
    if jax.process_count() == 1:
        return jax.device_put(x_AxBxT, sharding)
    return jax.make_array_from_callback(x_AxBxT.shape, sharding, lambda index: x_AxBxT[index])
