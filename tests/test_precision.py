"""Mixed precision on purpose: bf16 training stays near float32's, model.matmul_precision
reaches every product, train.deterministic sets XLA's flag, and the compilation cache finds
programs with custom partitioning (sharded cuDNN attention) again in a new process."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.schema import load_config, resolve_config_path
from model.accelerators.lowering import training_programs
from model.accelerators.plan import planned_config
from model.accelerators.program_text import product_dtypes
from model.network import precision
from model.network.precision import bf16_operand_product
from model.processes.determinism import DETERMINISM_FLAG, configure_determinism
from model.training.trainer import Trainer
from plumbing.errors import UsageError
from tests.child_env import child_env
from tests.multidevice_run import train_steps
from tests.tiny_runs import write_word_corpus

ROOT = Path(__file__).resolve().parents[1]
# bf16 against float32 on the same seed and batches: the mean training loss of the last
# steps may differ by at most this much (nats; measured here: docs/accelerators.md).
BF16_LOSS_DISTANCE = 0.02


def train_losses(tmp_path, dtype: str, steps: int = 40, *overrides: str) -> list[float]:
    from tokenizer.char import CharTokenizer

    corpus = write_word_corpus(tmp_path / "words.txt", 400).read_text()
    tok = CharTokenizer.train(corpus)
    tokens = np.asarray(tok.encode(corpus), np.uint16)
    cfg = load_config(
        resolve_config_path("shakespeare_char"),
        [f"model.dtype={dtype}", "model.n_layer=1", "model.n_embd=64", "model.block_size=32",
         "train.batch_size=8", "train.warmup_steps=5", f"train.max_steps={steps}", *overrides],
    )  # fmt: skip
    return train_steps(
        Trainer(cfg.train, cfg.model.for_vocab(tok.vocab_size)), tokens, range(steps)
    )[1]


def test_bf16_training_stays_near_float32(tmp_path):
    f32, bf16 = train_losses(tmp_path, "float32"), train_losses(tmp_path, "bfloat16")
    assert f32[-1] < f32[0] - 1.0  # it learns
    assert abs(np.mean(bf16[-10:]) - np.mean(f32[-10:])) < BF16_LOSS_DISTANCE
    assert bf16 != f32  # and it really ran in bf16


def test_bf16_operands_training_stays_near_float32(tmp_path):
    f32 = train_losses(tmp_path, "float32")
    bf16 = train_losses(tmp_path, "float32", 40, "model.linear_operands=bfloat16")
    assert abs(np.mean(bf16[-10:]) - np.mean(f32[-10:])) < BF16_LOSS_DISTANCE
    assert bf16 != f32  # the products really took bf16 operands


def bf16(a):
    """`a` rounded to bf16, back in float32: what a bf16 operand holds."""
    return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32))


def test_bf16_operand_product_and_its_gradients():
    rng = np.random.default_rng(0)
    x, w, g = (rng.standard_normal(s).astype(np.float32) for s in ((2, 5, 8), (8, 6), (2, 5, 6)))
    y, pullback = jax.vjp(bf16_operand_product, jnp.asarray(x), jnp.asarray(w))
    dx, dw = pullback(jnp.asarray(g))
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32
    np.testing.assert_allclose(y, bf16(x) @ bf16(w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, bf16(g) @ bf16(w).T, rtol=1e-5, atol=1e-5)
    # the kernel's gradient is float32's: the tokens' product of x and g as they are
    np.testing.assert_allclose(dw, x.reshape(-1, 8).T @ g.reshape(-1, 6), rtol=1e-5, atol=1e-5)
    assert not np.allclose(y, x @ w, rtol=1e-4, atol=1e-4)  # and it rounded


def test_bf16_operand_products_are_bf16_forward_and_backward():
    """XLA:CPU takes only a product whose operands are bf16 with a float32 result to its bf16
    kernels: the forward and the input's gradient are that, the kernel's gradient float32."""
    grad = jax.grad(lambda x, w: bf16_operand_product(x, w).sum(), argnums=(0, 1))
    jaxpr = jax.make_jaxpr(grad)(jnp.ones((4, 8)), jnp.ones((8, 6)))
    bf16_product, f32_product = ("bfloat16", "bfloat16", "float32"), ("float32",) * 3
    assert sorted(product_dtypes(jaxpr)) == [bf16_product, bf16_product, f32_product]


@pytest.mark.parametrize(("flags", "expected"), [({"amx_bf16", "avx512f"}, "bfloat16"),
                                                 ({"avx512f", "avx512_bf16"}, "float32"),
                                                 (set(), "float32")])  # fmt: skip
def test_auto_linear_operands_are_bf16_only_with_amx(monkeypatch, flags, expected):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(flags))
    assert precision.linear_operands_dtype("auto") == jnp.dtype(expected)
    assert precision.linear_operands_dtype("float32") == jnp.float32


def test_a_bf16_operand_linear_is_a_linear():
    from flax import nnx

    from model.network.config import ModelConfig
    from model.network.layers import linear

    def made(operands):
        cfg = ModelConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16,
                          linear_operands=operands)  # fmt: skip
        return linear(cfg.validate(), 16, 32, 0.02, nnx.Rngs(0))

    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 16)), jnp.float32)
    plain, rounded = made("float32"), made("bfloat16")
    np.testing.assert_allclose(rounded(x), plain(x), rtol=0.05, atol=0.01)  # the same weights
    np.testing.assert_allclose(rounded(x), bf16(x) @ bf16(plain.kernel[...]), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    with pytest.raises(UsageError, match="linear_operands"):
        ModelConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16,
                    linear_operands="bf16").validate()  # fmt: skip


def lowered_train_step(*overrides: str) -> str:
    cfg = planned_config(
        load_config(resolve_config_path("shakespeare"), ["model.n_layer=1", *overrides])
    )
    step = training_programs(cfg, devices=1, variants=())[0]
    return step.trace().lower(lowering_platforms=("tpu",)).as_text()


def test_matmul_precision_reaches_every_product():
    """Every product of the model, forward and backward (AdamW adds none of its own; Muon's
    orthogonalisation keeps JAX's default, as its reference runs it in bf16)."""
    adamw = ("train.optimizer=adamw", "train.normuon=false")

    def products(text: str) -> list[str]:  # (jax 0.12 also marks exp and erf HIGHEST accuracy)
        return [line for line in text.splitlines() if "stablehlo.dot_general" in line]

    with jax.default_matmul_precision("default"):  # JAX's own default, whatever the session's
        default = products(lowered_train_step(*adamw))
    assert default and not any("HIGHEST" in line for line in default)
    highest = products(lowered_train_step(*adamw, "model.matmul_precision=highest"))
    assert len(highest) == len(default) and all("HIGHEST" in line for line in highest)
    with pytest.raises(UsageError, match=r"model\.matmul_precision must be one of default"):
        load_config(resolve_config_path("shakespeare"), ["model.matmul_precision=fast"])


def test_deterministic_adds_xlas_flag_unless_the_user_set_it():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert configure_determinism(True, env)
    assert env["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=2",
        f"{DETERMINISM_FLAG}=true",
    ]
    theirs = {"XLA_FLAGS": f"{DETERMINISM_FLAG}=false"}
    assert not configure_determinism(True, theirs)
    assert theirs["XLA_FLAGS"] == f"{DETERMINISM_FLAG}=false"
    assert not configure_determinism(False, {}) and configure_determinism(False, {}) is False


# A custom-partitioned function (as sharded cuDNN attention is) compiled on 2 devices with the
# CLI's compilation cache; prints how often JAX found it in its disk cache.
CACHE_SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from model.processes.compilation_cache import enable_compilation_cache
enable_compilation_cache()
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
if {keep_pointer}:
    jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", False)
import logging
hits = []  # JAX's own report of a persistent-cache hit for this program
class Hits(logging.Handler):
    def emit(self, record):
        if "cache hit for 'jit_apply'" in record.getMessage():
            hits.append(1)
logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
logging.getLogger("jax._src.compiler").addHandler(Hits())

@custom_partitioning
def double(x):
    return 2 * x

def partition(mesh, arg_shapes, result_shape):
    sharding = arg_shapes[0].sharding
    return mesh, lambda x: 2 * x, sharding, (sharding,)

double.def_partition(
    partition=partition,
    infer_sharding_from_operands=lambda mesh, args, result: args[0].sharding,
    sharding_rule="i -> i")
def apply(x):
    return double(x)

mesh = Mesh(np.array(jax.devices()), ("data",))
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
out = jax.jit(apply)(x)
assert "CustomSPMDPartitioning" in jax.jit(apply).lower(x).as_text()
print(json.dumps({{"hits": len(hits), "sum": float(out.sum())}}))
"""


@pytest.mark.parametrize("keep_pointer", [False, True], ids=["cli-setting", "jax-default"])
def test_compilation_cache_finds_custom_partitioned_programs(tmp_path, keep_pointer):
    env = {
        **child_env(devices=2),
        "JAX_PLATFORMS": "cpu",  # two devices on any machine: a GPU host's one GPU has no split
        "TINYLLM_XLA_CACHE": str(tmp_path / "cache"),
    }
    script = CACHE_SCRIPT.format(root=str(ROOT), keep_pointer=keep_pointer)
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0] == {"hits": 0, "sum": 56.0}
    # The second process finds the first one's program, unless the pointer is in the key.
    assert runs[1]["hits"] == (0 if keep_pointer else 1)


@pytest.mark.parametrize("shape", [(1, 8), (1, 1, 8)])
def test_a_one_row_bf16_product_is_the_rows_product(shape):
    """One row (a decode step of one sequence) is multiplied as two rows, the second zeros:
    the same row as in a batch of three, and bf16's product."""
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal(shape).astype(np.float32), rng.standard_normal((8, 6))
    w = w.astype(np.float32)
    y = bf16_operand_product(jnp.asarray(x), jnp.asarray(w))
    assert y.shape == (*shape[:-1], 6) and y.dtype == jnp.float32
    np.testing.assert_allclose(y, bf16(x) @ bf16(w), rtol=1e-5, atol=1e-5)
    batch = np.concatenate([x.reshape(1, 8), rng.standard_normal((2, 8)).astype(np.float32)])
    in_batch = bf16_operand_product(jnp.asarray(batch), jnp.asarray(w))[:1]
    np.testing.assert_allclose(y.reshape(1, 6), in_batch, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("operands", ["bfloat16", "float32"])
def test_sampling_keeps_bf16_operand_kernels_as_bf16_with_the_same_logits(operands):
    """The blocks' bf16-operand kernels are stored bf16 for sampling, and the model's logits,
    one row decoding and several rows at once, stay the same bit for bit; an untied output
    layer, the embeddings and a float32-operand model's kernels keep float32."""
    from flax import nnx

    from model.network.config import ModelConfig
    from model.network.gpt import GPT
    from model.network.layers import store_bf16_operand_kernels

    cfg = ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32,
                      tie_embeddings=False, linear_operands=operands).validate()  # fmt: skip
    model = GPT(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (3, 9)), jnp.int32)

    def logits(m):
        one, _ = m.decode(tokens[:1, :1], m.init_cache(1), 0)
        return np.asarray(one), np.asarray(m(tokens))

    before = logits(model)
    store_bf16_operand_kernels(model)
    dtypes = {jax.tree_util.keystr(p): v.dtype
              for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model))}  # fmt: skip
    kernels = {k: v for k, v in dtypes.items() if "blocks" in k and "kernel" in k}
    assert len(kernels) == 8  # 4 Linear layers a block
    expected = jnp.bfloat16 if operands == "bfloat16" else jnp.float32
    assert set(kernels.values()) == {jnp.dtype(expected)}
    others = {v for k, v in dtypes.items() if k not in kernels}
    assert others == {jnp.dtype(jnp.float32)}  # lm_head, embeddings, norms
    after = logits(model)
    for b, a in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
