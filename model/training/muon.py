"""Muon as optax transforms, with the speedrun's options: Polar Express coefficients,
NorMuon's per-neuron normalisation, cautious weight decay.

`muon` builds what `optax.contrib.muon` builds (the same transforms, the same state; a test
pins it) with two seams optax's has not: a step between orthogonalisation and the update's
shape scaling (NorMuon), and the weight decay (cautious). The orthogonalisation itself is
optax's `scale_by_muon`, which takes one coefficient triple per iteration.

    >>> [len(ns_coefficients(o, 3)) for o in ("newton_schulz", "polar_express")]
    [3, 3]
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from model.training.muon_coefficients import NEWTON_SCHULZ, POLAR_EXPRESS
from model.training.muon_split import axes_of, scale_by_muon

# NorMuon's second-moment decay (Li et al. 2025, arXiv:2510.05491: beta2 = 0.95 in the
# paper's code, github.com/zichongli5/NorMuon, and in nanochat's Muon groups).
NORMUON_BETA2 = 0.95


def ns_coefficients(orthogonalizer: str, steps: int):
    """What optax's scale_by_muon takes as `ns_coeffs`: one triple for Newton-Schulz, one
    triple per iteration for Polar Express (`steps` of them: 5, the config checks)."""
    if orthogonalizer == "polar_express":
        return POLAR_EXPRESS[:steps]
    return NEWTON_SCHULZ


def _per_leaf(dimensions, updates, fn, *trees):
    """fn(update, *leaves, dims) over the leaves of `updates` (masked-out nodes skipped)."""
    dims = dimensions(updates)
    return jax.tree.map(lambda u, *rest: fn(u, *rest), updates, *trees, dims)


def width_scaling(dimensions) -> optax.GradientTransformation:
    """Muon's shape scaling, sqrt(max(1, fan_out / fan_in)) (Keller Jordan's Muon; optax's
    scale_by_shape without consistent_rms, which optax does not export)."""

    def scale(u, dims):
        fan_in = 1
        for a in axes_of(dims.reduction_axis, u.ndim):
            fan_in *= u.shape[a]
        fan_out = 1
        for a in axes_of(dims.output_axis, u.ndim):
            fan_out *= u.shape[a]
        return u * jnp.sqrt(jnp.maximum(1, fan_out / fan_in))

    return optax.stateless(lambda updates, params: _per_leaf(dimensions, updates, scale))


class NorMuonState(NamedTuple):
    nu: optax.Updates  # per output neuron: the parameter's shape, reduction axes of size 1


def normuon(dimensions, beta2: float = NORMUON_BETA2) -> optax.GradientTransformation:
    """NorMuon (Li et al. 2025): each output neuron's share of the orthogonalised update
    divided by the root of a running mean of its squares (mean over the neuron's inputs),
    then the matrix rescaled to the Frobenius norm it had: orthogonalisation leaves neurons
    with uneven update sizes, this evens them while Muon's overall step size stays.

    As nanochat's muon_step_fused and the paper's normuon_update: no bias correction (a
    common factor the rescaling cancels), the second moment floored at 1e-10. A Linear
    kernel [in, out] keeps [1, out]; an expert stack [E, in, out] keeps [E, 1, out].
    """

    def neuron_shape(p, dims):
        red = axes_of(dims.reduction_axis, p.ndim)
        return tuple(1 if i in red else n for i, n in enumerate(p.shape))

    def init(params):
        return NorMuonState(
            nu=_per_leaf(
                dimensions, params, lambda p, d: jnp.zeros(neuron_shape(p, d), jnp.float32)
            )
        )

    def moment(u, nu, dims):
        mean_square = jnp.mean(u * u, axis=axes_of(dims.reduction_axis, u.ndim), keepdims=True)
        return nu + (1 - beta2) * (mean_square - nu)

    def normalize(u, nu, dims):
        matrix = axes_of(dims.reduction_axis, u.ndim) + axes_of(dims.output_axis, u.ndim)
        scaled = u * jax.lax.rsqrt(jnp.maximum(nu, 1e-10))
        norm = jnp.sqrt(jnp.sum(u * u, axis=matrix, keepdims=True))  # per matrix, not per
        new_norm = jnp.sqrt(jnp.sum(scaled * scaled, axis=matrix, keepdims=True))  # stack
        return scaled * (norm / jnp.maximum(new_norm, 1e-10))

    def update(updates, state, params=None):
        del params
        nu = _per_leaf(dimensions, updates, moment, state.nu)
        return _per_leaf(dimensions, updates, normalize, nu), NorMuonState(nu=nu)

    return optax.GradientTransformation(init, update)


def weight_decay(rate: float, cautious: bool, mask=None) -> optax.GradientTransformation:
    """Decoupled weight decay, added to the update before the learning rate scales it, so its
    strength at step t is rate x lr(t): it follows the warmup and decay of the schedule, as
    nanochat's lr * wd * p and modded-nanogpt's lr-scaled decay do.

    cautious (Chen et al. 2025, arXiv:2510.12402; nanochat's and modded-nanogpt's Muon): only
    where the update and the parameter agree in sign (u * p >= 0, the step already pulls the
    weight toward zero), so decay never fights the gradient. Stateless either way: the
    optimizer state is the same with and without it.
    """
    if not cautious:
        return optax.add_decayed_weights(rate, mask)

    def decay(updates, params):
        return jax.tree.map(lambda u, p: u + rate * p * (u * p >= 0), updates, params)

    tx = optax.stateless(decay)
    return tx if mask is None else optax.masked(tx, mask)


def muon(train_cfg, matrices_lr, adam_lr, dimensions, mesh=None) -> optax.GradientTransformation:
    """optax.contrib.muon's partition: the parameters `dimensions` (a callable, as optax's
    muon_weight_dimension_numbers) gives dimension numbers to get Muon at `matrices_lr` with
    train.weight_decay; the others (None) AdamW at `adam_lr` with Nesterov moments, no
    decay. train.muon_orthogonalizer, train.normuon and train.cautious_weight_decay choose
    the options. With `mesh` (replicated parameters on several devices) the devices share
    the orthogonalisation out (model/training/muon_split.py)."""
    t = train_cfg
    matrices = [
        scale_by_muon(
            ns_coefficients(t.muon_orthogonalizer, t.muon_ns_steps),
            t.muon_ns_steps,
            dimensions,
            mesh,
        ),
        *([normuon(dimensions)] if t.normuon else []),
        width_scaling(dimensions),
        weight_decay(t.weight_decay, t.cautious_weight_decay),
        optax.scale_by_learning_rate(matrices_lr),
    ]
    rest = optax.adamw(adam_lr, b1=t.beta1, b2=t.beta2, eps=1e-8, weight_decay=0.0, nesterov=True)

    def labels(params):
        is_spec = lambda x: x is None or isinstance(x, MuonDimensionNumbers)  # noqa: E731
        pick = lambda spec: "adam" if spec is None else "muon"  # noqa: E731
        return jax.tree.map(pick, dimensions(params), is_leaf=is_spec)

    return optax.partition({"muon": optax.chain(*matrices), "adam": rest}, labels)
