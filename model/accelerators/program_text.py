"""What a lowered program holds: the checks model/accelerators/lowering.py runs on the StableHLO
text of each program (float64, host callbacks, cuDNN's fused attention where expected) and on
its traced jaxpr (float32 x bf16 products without the bf16 algorithm; control flow a GPU
decides on its host).

    >>> inspect_text("func.func @main(%arg0: tensor<2xf64>)", cudnn_expected=False)
    ['float64 values in the program']
    >>> custom_call_targets('stablehlo.custom_call @__cudnn$fmhaSoftmax(%0)')
    ['__cudnn$fmhaSoftmax']
"""

from __future__ import annotations

import re

import jax

CUDNN_CALL = "__cudnn$fmha"
CUSTOM_PARTITIONING = "CustomSPMDPartitioning"


def inspect_text(text: str, cudnn_expected: bool, backward: bool = False) -> list[str]:
    """What is wrong with a lowered program's StableHLO text (empty: nothing); with
    `backward`, cuDNN's attention is expected in both directions (a train step)."""
    problems = []
    if re.search(r"[<x]f64>", text):
        problems.append("float64 values in the program")
    targets = custom_call_targets(text)
    callbacks = sorted({t for t in targets if "callback" in t.lower()})
    if callbacks:
        problems.append(f"host callbacks: {', '.join(callbacks)}")
    partitioned = custom_partitioning_rules(text)
    foreign = sorted({rule for rule in partitioned if not _is_cudnn_rule(rule)})
    if foreign:
        problems.append(f"host callbacks of custom partitioning: {', '.join(foreign)}")
    # cuDNN's attention: its custom calls on one device; on several, JAX's partitioning rules
    # for them, which XLA's partitioner turns into the same calls on each device's shard.
    cudnn = [t for t in targets if t.startswith(CUDNN_CALL)]
    cudnn += [rule for rule in partitioned if _is_cudnn_rule(rule)]
    has_backward = any("backward" in c.lower() or "_bwd_" in c for c in cudnn)
    has_forward = any(not ("backward" in c.lower() or "_bwd_" in c) for c in cudnn)
    if cudnn_expected and not (has_forward and (has_backward or not backward)):
        direction = "forward and backward" if backward else "forward"
        problems.append(
            f"cuDNN attention ({direction}) expected on an H100 in bf16 but not in the program"
        )
    if cudnn and not cudnn_expected:
        problems.append("cuDNN attention where the model should not pick it")
    return problems


def host_syncs(jaxpr, platform: str) -> list[str]:
    """Control flow of a traced program that XLA:GPU (cuda, rocm) decides on the host,
    waiting for the device each time (xla/backends/gpu/runtime: ConditionalThunk, WhileThunk):
    every conditional (its predicate is copied back), and every `while` (a loop over a count
    not fixed when tracing; its condition is copied back every turn). Scans, and fori_loops
    over Python ints, which JAX traces as scans, have trip counts XLA knows. A
    `jax.lax.platform_dependent` choice is no conditional: the lowering keeps `platform`'s
    branch alone, and only that branch is looked into. A GPU launch of a program with either
    returns only when the device reaches its end; TPUs decide both on the device."""
    conditionals, loops = _host_decided(jaxpr, platform)
    found = []
    if conditionals:
        found.append(f"{conditionals} conditional(s) decided on the host")
    if loops:
        found.append(f"{loops} while loop(s) over a traced count")
    return found


def _host_decided(jaxpr, platform: str) -> tuple[int, int]:
    """(conditionals, while loops) of a (closed) jaxpr and its sub-jaxprs on `platform`."""
    conditionals = loops = 0
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        subs = _sub_jaxprs(eqn)
        if eqn.primitive.name == "cond":
            platforms = eqn.params.get("branches_platforms")
            if platforms is None:
                conditionals += 1
            else:
                subs = [_platform_branch(eqn.params["branches"], platforms, platform)]
        elif eqn.primitive.name == "while":
            loops += 1
        for sub in subs:
            more_conditionals, more_loops = _host_decided(sub, platform)
            conditionals, loops = conditionals + more_conditionals, loops + more_loops
    return conditionals, loops


def _platform_branch(branches, platforms, platform: str):
    """The branch of a platform-dependent cond that `platform` runs (else the default)."""
    for branch, names in zip(branches, platforms, strict=True):
        if names is not None and platform in names:
            return branch
    return branches[list(platforms).index(None)]


def custom_call_targets(text: str) -> list[str]:
    return re.findall(r"custom_call @([\w$.\-]+)", text)


def custom_partitioning_rules(text: str) -> list[str]:
    """The partition rule (module.function) behind each custom-partitioning call, as JAX
    registered it while lowering ("unknown" when it cannot be found)."""
    from jax._src import custom_partitioning

    rules = []
    pattern = CUSTOM_PARTITIONING + r"\(.*?backend_config = \"(\d+)\""
    for key in re.findall(pattern, text):
        info = custom_partitioning._sharding_callbacks.get(key.encode())
        partition = getattr(info, "partition", None)
        name = getattr(partition, "__qualname__", None) or "unknown"
        rules.append(f"{getattr(partition, '__module__', '?')}.{name}")
    return rules


def _is_cudnn_rule(rule: str) -> bool:
    return "cudnn" in rule and "attention" in rule


def mixed_products(jaxpr) -> list[str]:
    """Matrix products of the traced program (sub-programs included) that multiply a float32
    operand by a bf16 one without the bf16 algorithm: XLA upcasts the bf16 side and runs them
    in float32 (on GPU; TPUs may keep them mixed). Checked on the jaxpr, where they are still
    mixed, rather than on the lowered text, where the upcast hides them."""
    found = []
    for eqn in _equations(jaxpr):
        if eqn.primitive.name != "dot_general":
            continue
        left, right = (str(v.aval.dtype) for v in eqn.invars)
        precision = eqn.params.get("precision")
        if left != right and not isinstance(precision, jax.lax.DotAlgorithmPreset):
            shapes = " x ".join(f"{v.aval.dtype}{list(v.aval.shape)}" for v in eqn.invars)
            found.append(shapes)
    return found


def product_dtypes(jaxpr) -> list[tuple[str, str, str]]:
    """(left operand, right operand, result) dtype of each matrix product of the traced program,
    sub-programs included."""
    return [
        (*(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype))
        for eqn in _equations(jaxpr)
        if eqn.primitive.name == "dot_general"
    ]


def _equations(jaxpr):
    """Every equation of a (closed) jaxpr and of the jaxprs in its equations' parameters."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for sub in _sub_jaxprs(eqn):
            yield from _equations(sub)


def _sub_jaxprs(eqn) -> list:
    """The jaxprs in an equation's parameters (a cond's branches, a loop's body, a jit's)."""
    return [
        sub
        for value in eqn.params.values()
        for sub in (value if isinstance(value, (tuple, list)) else (value,))
        if hasattr(getattr(sub, "jaxpr", sub), "eqns")
    ]
