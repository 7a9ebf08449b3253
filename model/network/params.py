"""The network's parameters without running it: the abstract model, and parameter names.

Loading weights (a checkpoint, a quantized file, GPT-2's safetensors) needs only the model's
structure and shapes to restore into: `abstract_model` gives them without running an
initialiser.

    >>> from model.network.config import ModelConfig
    >>> cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    >>> graphdef, params, rest = abstract_model(cfg)
    >>> params["wte"]["embedding"].shape
    (64, 32)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from model.network.config import ModelConfig
from model.network.gpt import GPT

if TYPE_CHECKING:
    from model.decoding.program_cache import ProgramCache


def abstract_model(cfg: ModelConfig, cache: ProgramCache | None = None) -> tuple[Any, Any, Any]:
    """(graphdef, params as ShapeDtypeStructs placed on the default device, the rest of the
    state) of a GPT with `cfg`, built without running its initialisers.

    With a `cache`, read from it (tracing the initialisers is most of loading a small model),
    or stored in it. Non-parameter state needs real values: a model that has some is built
    for real (and not cached).
    """
    arguments = dataclasses.asdict(cfg)
    stored = cache.get("abstract-model", arguments) if cache is not None else None
    if isinstance(stored, tuple) and len(stored) == 3:
        graphdef, params, rest = stored
    else:
        model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(params=0)))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if jax.tree_util.tree_leaves(rest):
            graphdef, _, rest = nnx.split(GPT(cfg, rngs=nnx.Rngs(params=0)), nnx.Param, ...)
        params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        if cache is not None and not jax.tree_util.tree_leaves(rest):
            cache.put("abstract-model", arguments, (graphdef, params, rest))
    device = jax.sharding.SingleDeviceSharding(sampling_device())
    params = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), params
    )
    return graphdef, params, rest


def sampling_device() -> jax.Device:
    """Where one process samples and serves (its weights, cache and programs): its own first
    device. With several processes, jax.devices()[0] is process 0's, which the others cannot
    address."""
    return jax.local_devices()[0]


def path_names(path: tuple) -> tuple[str, ...]:
    """A pytree key path as plain names, without nnx's trailing `.value`:
    ('blocks', '0', 'attn', 'c_attn', 'kernel')."""
    names = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        names.append(str(name))
    if names and names[-1] == "value":
        names.pop()
    return tuple(names)
