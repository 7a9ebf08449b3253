"""Muon's orthogonalisation shared out over the devices of a data-parallel mesh.

With replicated parameters every device would orthogonalise every matrix: on 2 CPU devices
that is about a fifth of the fast config's step, done twice. As modded-nanogpt's distributed
Muon does, each device here orthogonalises its share of the matrices and one all-gather
gives every device all of them. Matrices of one shape are stacked and run as one batched
Newton-Schulz, which is what optax's vmap does for a single stack; the values are optax's
(tests/test_optim.py compares them).

`scale_by_muon` is `optax.contrib.scale_by_muon` (its momentum, its state) with that
orthogonalisation; without a mesh of several devices it is optax's own.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonState

MOMENTUM = 0.95  # optax's scale_by_muon defaults: beta, eps, Nesterov
EPS = 1e-8


def scale_by_muon(ns_coeffs, ns_steps: int, dimensions, mesh=None):
    """optax.contrib.scale_by_muon(ns_coeffs, ns_steps, weight_dimension_numbers=dimensions);
    with `mesh` (a one-axis mesh of several devices, parameters replicated over it) each
    device orthogonalises only its share of the matrices."""
    reference = optax.contrib.scale_by_muon(
        ns_coeffs=ns_coeffs, ns_steps=ns_steps, weight_dimension_numbers=dimensions
    )
    if mesh is None or mesh.devices.size == 1:
        return reference

    def update(updates, state, params=None):
        del params
        # optax's Nesterov momentum with bias correction, as its scale_by_muon computes it.
        mu = optax.tree.update_moment(updates, state.mu, MOMENTUM, 1)
        count = optax.safe_increment(state.count)
        mu_hat = jax.tree.map(
            lambda m, g: MOMENTUM * m + (1 - MOMENTUM) * g,
            optax.tree.bias_correction(mu, MOMENTUM, optax.safe_increment(count)),
            optax.tree.bias_correction(updates, MOMENTUM, count),
        )
        ortho = orthogonalize_shared(mu_hat, dimensions(updates), state.ns_coeffs, ns_steps, mesh)
        return ortho, MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(reference.init, update)


def newton_schulz(x_NxRxC, coeffs, ns_steps: int):
    """optax's orthogonalize_via_newton_schulz (Frobenius preconditioning) on a stack of
    matrices with rows <= columns: one coefficient triple for every iteration, or one each."""
    x = x_NxRxC / (jnp.linalg.norm(x_NxRxC, axis=(1, 2), keepdims=True) + EPS)
    coeffs = coeffs.astype(x.dtype)
    for i in range(ns_steps if coeffs.ndim == 1 else coeffs.shape[0]):
        c = coeffs if coeffs.ndim == 1 else coeffs[i]
        a = x @ jnp.swapaxes(x, 1, 2)
        x = c[0] * x + (c[1] * a + c[2] * a @ a) @ x
    return x


def _as_matrices(x, spec):
    """x as a stack [N, R, C] with R <= C (optax's reshape, then its transpose of tall
    matrices), and the function that puts such a stack back into x's shape."""
    red = axes_of(spec.reduction_axis, x.ndim)
    out = axes_of(spec.output_axis, x.ndim)
    batch = tuple(a for a in range(x.ndim) if a not in red + out)
    order = batch + red + out
    r = math.prod(x.shape[a] for a in red)
    c = math.prod(x.shape[a] for a in out)
    stack = x.transpose(order).reshape(-1, r, c)
    tall = r > c
    moved = tuple(x.shape[a] for a in order)
    inverse = tuple(sorted(range(x.ndim), key=lambda i: order[i]))

    def back(m):
        m = jnp.swapaxes(m, 1, 2) if tall else m
        return m.reshape(moved).transpose(inverse)

    return (jnp.swapaxes(stack, 1, 2) if tall else stack), back


def axes_of(axis, ndim: int) -> tuple[int, ...]:
    """A dimension number's axis or axes (an int or a tuple, negative ones counted from the
    end) as a tuple of non-negative axes of an ndim-dimensional array."""
    return tuple(a % ndim for a in ((axis,) if isinstance(axis, int) else axis))


def orthogonalize_shared(tree, dimensions, coeffs, ns_steps: int, mesh):
    """Every matrix of `tree` orthogonalised (its dimension numbers in `dimensions`), the
    work shared over `mesh`'s one axis: each device runs Newton-Schulz on its slice of each
    stack of same-shaped matrices, and one all-gather returns them all."""
    (axis,) = mesh.axis_names
    n = mesh.devices.size
    leaves, treedef = jax.tree.flatten(tree)
    matrices, backs = zip(
        *(
            _as_matrices(x, s)
            for x, s in zip(leaves, treedef.flatten_up_to(dimensions), strict=True)
        ),
        strict=True,
    )
    groups, stacks = _stacks_by_shape(matrices, n)

    def share(*stacks_):
        me = jax.lax.axis_index(axis)
        done = []
        for stack in stacks_:
            per = stack.shape[0] // n
            mine = jax.lax.dynamic_slice_in_dim(stack, me * per, per)
            done.append(newton_schulz(mine, coeffs, ns_steps).reshape(-1))
        return jax.lax.all_gather(jnp.concatenate(done), axis)  # [devices, share]

    # The all-gather makes the result the same on every device, which check_vma cannot see.
    in_specs = tuple(P() for _ in stacks)
    shared = jax.shard_map(share, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)
    gathered = shared(*stacks)
    out, offset = [None] * len(leaves), 0
    for members, stack in zip(groups, stacks, strict=True):
        size = stack.size // n  # each device's share of this stack, in device order
        result = gathered[:, offset : offset + size].reshape(stack.shape)
        offset += size
        start = 0
        for i in members:
            out[i] = backs[i](result[start : start + matrices[i].shape[0]])
            start += matrices[i].shape[0]
    return jax.tree.unflatten(treedef, out)


def _stacks_by_shape(matrices, n: int):
    """The indices of the matrix stacks of each shape, and those stacks concatenated, padded
    with zero matrices (which Newton-Schulz keeps zero) to a multiple of `n`."""
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(matrices):
        groups.setdefault(m.shape[1:], []).append(i)
    stacks = []
    for members in groups.values():
        stack = jnp.concatenate([matrices[i] for i in members])
        stacks.append(jnp.pad(stack, ((0, -stack.shape[0] % n), (0, 0), (0, 0))))
    return list(groups.values()), stacks
