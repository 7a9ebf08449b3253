"""`TrainState`: what training carries from one step to the next, as one immutable pytree.

Its leaves are held flat, in one tuple, with the layout (the params' and the optimizer
state's tree structures) beside them. The compiled step is called once a step with the whole
state: JAX flattens its arguments and rebuilds its outputs on every call, in Python for each
Flax Variable. Held as nested Variables, the fast config's 115 arrays cost 8-12 ms of host CPU
a step that way, and on a 2-core machine that CPU is taken from the two devices' compute.
Held flat, JAX sees one node over a tuple of arrays. `params` and `opt_state` are rebuilt
from the leaves when asked for (tracing the step, evaluating, saving).

    >>> import jax.numpy as jnp
    >>> s = TrainState({"w": jnp.ones(2)}, (jnp.zeros(2),), jnp.int32(3), jnp.uint32(0))
    >>> len(jax.tree_util.tree_leaves(s)), s.params["w"].shape, int(s.step)
    (4, (2,), 3)
    >>> jax.tree_util.keystr(jax.tree_util.tree_leaves_with_path(s)[0][0])
    ".params['w']"
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.tree_util import GetAttrKey, keystr, tree_flatten, tree_flatten_with_path

_FIELDS = ("params", "opt_state")


class TrainState:
    """params (nnx.State of the model's Params), opt_state (optax state: moments laid out as
    their params, FSDP sharded alike), step (int32 scalar, replicated: optimizer steps taken)
    and key (typed PRNG key, replicated).

    Only `Trainer` makes one; the compiled step returns the next. `key` is the run's base key,
    key(train.seed): step s draws its randomness (dropout) from fold_in(key, s), so the key is
    never saved and a resumed run replays the uninterrupted one exactly.
    """

    __slots__ = ("_layout", "_leaves")

    def __init__(self, params: Any, opt_state: Any, step: Any, key: Any) -> None:
        p, p_def = tree_flatten(params)
        o, o_def = tree_flatten(opt_state)
        self._leaves = (*p, *o, step, key)
        self._layout = (p_def, o_def)

    @classmethod
    def _of(cls, layout: tuple, leaves) -> TrainState:
        state = cls.__new__(cls)
        state._leaves, state._layout = tuple(leaves), layout
        return state

    @property
    def params(self) -> Any:
        p_def = self._layout[0]
        return p_def.unflatten(self._leaves[: p_def.num_leaves])

    @property
    def opt_state(self) -> Any:
        p_def, o_def = self._layout
        return o_def.unflatten(self._leaves[p_def.num_leaves : -2])

    @property
    def step(self) -> Any:
        return self._leaves[-2]

    @property
    def key(self) -> Any:
        return self._leaves[-1]

    def advanced(self, params: Any, opt_state: Any) -> TrainState:
        """The state after one optimizer step: new params and optimizer state, step + 1."""
        return TrainState(params, opt_state, self.step + 1, self.key)

    def steps_taken(self) -> int:
        """`step` read back to the host (waits for the device: for setting up, not in the
        loop, which counts steps itself)."""
        return int(np.asarray(self.step.addressable_data(0)))

    def _with_keys(self):
        # One key per leaf, spelling the leaf's whole path (".params['wte']['embedding']..."),
        # so that keystr reads as it would for the nested trees.
        keys = [
            GetAttrKey(name + keystr(path))
            for name, tree in zip(_FIELDS, (self.params, self.opt_state), strict=True)
            for path, _ in tree_flatten_with_path(tree)[0]
        ]
        keys += [GetAttrKey("step"), GetAttrKey("key")]
        return list(zip(keys, self._leaves, strict=True)), self._layout


jax.tree_util.register_pytree_with_keys(
    TrainState,
    TrainState._with_keys,
    TrainState._of,
    lambda s: (s._leaves, s._layout),
)
