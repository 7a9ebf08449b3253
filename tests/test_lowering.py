"""Every compiled program lowers for cuda, rocm and tpu from this CPU machine
(scripts/check_lowering.py, model/accelerators/lowering.py), and the checks on the lowered text
catch what they look for: float64, host callbacks, cuDNN attention missing or misplaced,
float32 x bf16 products, and control flow a GPU would leave to its host."""

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.schema import load_config, resolve_config_path
from model.accelerators.gpu_host import traced_as
from model.accelerators.lowering import (
    decode_programs,
    lower_all,
    lower_program,
    training_programs,
)
from model.accelerators.plan import planned_config
from model.accelerators.program_text import host_syncs, inspect_text, mixed_products
from tests.child_env import child_env

ROOT = Path(__file__).resolve().parents[1]
# The demo's shape, shrunk: two layers of 64 with head dim 32 (cuDNN's multiple of 8).
SMALL = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=32"]


def small_config(*extra: str):
    return planned_config(load_config(resolve_config_path("shakespeare"), [*SMALL, *extra]))


def lowered_text(f, *args, platform: str = "cpu") -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_inspection_catches_what_it_looks_for():
    x32 = jnp.ones((4, 8), jnp.float32)
    clean = lowered_text(lambda a: a @ a.T, x32)
    assert inspect_text(clean, cudnn_expected=False) == []
    with jax.enable_x64(True):
        f64 = lowered_text(lambda a: a.astype(jnp.float64).sum(), x32)
    assert inspect_text(f64, False) == ["float64 values in the program"]
    shape = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    callback = lowered_text(lambda a: jax.pure_callback(np.sin, shape, a), x32)
    assert inspect_text(callback, False)[0].startswith("host callbacks: xla_")
    assert "cuDNN attention (forward) expected" in inspect_text(clean, True)[0]
    forward = "%1 = stablehlo.custom_call @__cudnn$fmhaSoftmax(%0)"
    backward = "%2 = stablehlo.custom_call @__cudnn$fmhaSoftmaxBackward(%1)"
    assert inspect_text(forward, True) == []  # evaluation: forward only
    assert "(forward and backward) expected" in inspect_text(forward, True, backward=True)[0]
    assert inspect_text(forward + "\n" + backward, True, backward=True) == []
    assert "should not pick it" in inspect_text(forward, False)[0]


def test_float32_times_bf16_products_are_found_inside_the_program():
    """A float32 gradient meeting bf16 weights, as the unembedding's backward did: in the
    traced program, also inside scans and under grad; the bf16 algorithm clears it."""
    x32, w16 = jnp.ones((4, 8), jnp.float32), jnp.ones((8, 4), jnp.bfloat16)

    def product(x, w, precision=None):
        dims = (((1,), (0,)), ((), ()))
        return jax.lax.dot_general(x, w, dims, precision, preferred_element_type=jnp.float32)

    def scanned(x, w):
        return jax.lax.scan(lambda c, _: (c, product(x, w).sum()), 0.0, None, length=2)[1]

    assert mixed_products(jax.make_jaxpr(product)(x32, w16)) == ["float32[4, 8] x bfloat16[8, 4]"]
    assert len(mixed_products(jax.make_jaxpr(scanned)(x32, w16))) == 1
    pinned = jax.make_jaxpr(lambda x, w: product(x, w, "BF16_BF16_F32"))(x32, w16)
    assert mixed_products(pinned) == []
    x16 = x32.astype(jnp.bfloat16)
    bf16_grad = jax.make_jaxpr(jax.grad(lambda x, w: product(x, w).sum()))(x16, w16)
    assert len(mixed_products(bf16_grad)) == 1  # the float32 cotangent meets bf16 w


def test_host_syncs_finds_the_control_flow_a_gpu_would_wait_for():
    x = jnp.arange(64.0)

    def counted(x):
        return jax.lax.fori_loop(0, 4, lambda i, c: jnp.sort(c * x), x)

    def traced(x, n):
        return jax.lax.fori_loop(0, n, lambda i, c: jnp.sort(c * x), x)

    def branch(x):
        return jax.lax.cond(x[0] > 0, jnp.sort, lambda c: jnp.cumsum(c[::-1]), x)

    def per_platform(x):
        return jax.lax.platform_dependent(x, cpu=branch, default=jnp.sort)

    def syncs(f, *args, platform="cuda"):
        return host_syncs(jax.make_jaxpr(f)(*args), platform)

    assert syncs(counted, x) == []
    assert syncs(traced, x, 4) == ["1 while loop(s) over a traced count"]
    assert syncs(jax.jit(branch), x) == ["1 conditional(s) decided on the host"]
    assert syncs(per_platform, x) == []  # cuda's branch, chosen when lowering
    assert syncs(per_platform, x, platform="cpu") == ["1 conditional(s) decided on the host"]
    # What XLA itself finds, compiling here: the counted loop's trip count, the other's none.
    known = jax.jit(counted).lower(x).compile().as_text()
    assert re.search(r"known_trip_count.{0,10}\"n\":\"4\"", known), known
    unknown = jax.jit(traced).lower(x, 4).compile().as_text()
    assert "while(" in unknown and "known_trip_count" not in unknown


def test_a_decode_chunk_over_a_traced_step_count_is_caught():
    """The check on the real programs: the cached chunk as a CPU host traces it (a traced
    count, the filters' conditional) fails it for cuda; as a GPU host traces it, it passes."""
    program = next(p for p in decode_programs(small_config()) if p.name == "cached chunk")
    with traced_as("cuda"):
        as_on_gpu = program.trace().jaxpr
    with traced_as("cpu"):
        as_on_cpu = program.trace().jaxpr
    assert host_syncs(as_on_gpu, "cuda") == []
    assert host_syncs(as_on_cpu, "cuda") == ["1 while loop(s) over a traced count"]
    assert host_syncs(as_on_cpu, "cpu") == [
        "1 conditional(s) decided on the host",
        "1 while loop(s) over a traced count",
    ]


def test_every_program_and_variant_lowers_for_every_platform():
    """The demo's recipe (Muon, QK-norm, x0 mixing) and the variants, 1 device: clean, with
    cuDNN attention exactly where an H100 in bf16 runs it (whole sequences, not the cache)."""
    results = lower_all(small_config(), platforms=("cuda", "tpu"))  # rocm lowers as tpu traces
    assert {(r.platform, r.dtype) for r in results} == {
        (p, d) for p in ("cuda", "tpu") for d in ("float32", "bfloat16")
    }
    assert [r for r in results if not r.ok] == []
    names = {r.program for r in results}
    for name in ("muon", "adamw", "accumulation", "moe", "qat int4"):
        assert f"train step ({name})" in names
    assert {"evaluation", "refill (prefill, slides)", "cached chunk", "uncached chunk"} <= names
    assert {"scored refill", "put_row", "take_row", "batch_chunk"} <= names
    cudnn = {r.program for r in results if r.attention == "cudnn"}
    assert {(r.platform, r.dtype) for r in results if r.attention == "cudnn"} == {
        ("cuda", "bfloat16")
    }
    assert cudnn == {n for n in names if n.startswith("train step")} | {
        "evaluation",
        "uncached chunk",
    }
    cudnn_calls = {c for r in results if r.attention == "cudnn" for c in r.custom_calls}
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= cudnn_calls


def test_dropout_trains_through_the_reference_attention_and_evaluates_through_cudnn():
    cfg = small_config("model.dropout=0.1")
    results = lower_all(cfg, ("cuda", "rocm"), ("bfloat16",), ("train",), variants=())
    by_name = {r.program: r for r in results if r.platform == "cuda"}
    assert all(r.ok for r in results)
    assert by_name["train step (muon)"].attention == "reference"
    assert not any(c.startswith("__cudnn") for c in by_name["train step (muon)"].custom_calls)
    assert by_name["evaluation"].attention == "cudnn"


@pytest.mark.parametrize("where", ["unembedding", "attention scores"])
def test_a_float32_backward_in_bf16_is_caught(monkeypatch, where):
    """Without the bf16 algorithm on the products whose result is float32, their backward
    passes multiply a float32 gradient by bf16 operands, in float32; the check says so."""
    import model.network.attention as attention
    import model.network.gpt as gpt

    cfg = small_config("model.dtype=bfloat16", "model.attention=reference")
    step = training_programs(cfg, devices=1, variants=())[0]
    [before] = lower_program(step, ["tpu"], cfg.model)
    assert before.ok, before.problems
    module = gpt if where == "unembedding" else attention
    monkeypatch.setattr(module, "mixed_product_precision", lambda dtype: None)
    [after] = lower_program(step, ["tpu"], cfg.model)
    assert any("products would run in float32" in p for p in after.problems), after.problems


def test_cudnn_config_is_not_lowered_where_the_model_refuses_it():
    cfg = small_config("model.attention=cudnn", "model.dtype=bfloat16")
    results = lower_all(cfg, ("cuda", "tpu"), ("float32", "bfloat16"), ("train",), variants=())
    assert {r.dtype for r in results} == {"bfloat16"}  # cuDNN takes no float32
    assert all(r.attention == "n/a" for r in results if r.platform == "tpu")
    assert all(r.ok and r.attention == "cudnn" for r in results if r.platform == "cuda")


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_lowering.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_gpt2_small_lowers_sharded_over_eight_devices_with_cudnn():
    """Full-size GPT-2 small, built abstractly (nothing allocated), data parallel and FSDP over
    8 devices: sharded cuDNN attention arrives as JAX's custom partitioning of it."""
    proc = run_script(
        "--config", "gpt2_124m", "--devices", "8", "--programs", "train", "--variants", "none",
        "--platforms", "cuda,tpu",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "12 layers x 768, context 1024, vocab 50,257; 8 CPU device(s)" in proc.stderr
    cells = [re.split(r"\s{2,}", line.strip()) for line in proc.stdout.splitlines()]
    assert cells[0] == ["program", "cuda f32", "tpu f32", "cuda bf16", "tpu bf16"]
    rows = {row[0]: row[1:] for row in cells[1:]}
    assert list(rows) == ["train step (adamw)", "train step (adamw, fsdp)", "evaluation"]
    assert all(row == ["ok", "ok", "ok cuDNN", "ok"] for row in rows.values()), proc.stdout
    assert "12 of 12 lowerings clean" in proc.stderr


def test_script_refuses_bad_choices_in_one_line():
    proc = run_script("--platforms", "cuda,metal")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "check_lowering: error: --platforms takes cuda, rocm, tpu; got 'cuda,metal'"
    ]
