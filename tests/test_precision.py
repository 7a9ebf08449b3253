"""Mixed precision on purpose: bf16 training stays near float32's, model.matmul_precision
reaches every product, train.deterministic sets XLA's flag, and the compilation cache finds
programs with custom partitioning (sharded cuDNN attention) again in a new process."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from configs.schema import load_config, resolve_config_path
from model.accelerators.lowering import training_programs
from model.accelerators.plan import planned_config
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


def train_losses(tmp_path, dtype: str, steps: int = 40) -> list[float]:
    from tokenizer.char import CharTokenizer

    corpus = write_word_corpus(tmp_path / "words.txt", 400).read_text()
    tok = CharTokenizer.train(corpus)
    tokens = np.asarray(tok.encode(corpus), np.uint16)
    cfg = load_config(
        resolve_config_path("shakespeare_char"),
        [f"model.dtype={dtype}", "model.n_layer=1", "model.n_embd=64", "model.block_size=32",
         "train.batch_size=8", "train.warmup_steps=5", f"train.max_steps={steps}"],
    )  # fmt: skip
    return train_steps(
        Trainer(cfg.train, cfg.model.for_vocab(tok.vocab_size)), tokens, range(steps)
    )[1]


def test_bf16_training_stays_near_float32(tmp_path):
    f32, bf16 = train_losses(tmp_path, "float32"), train_losses(tmp_path, "bfloat16")
    assert f32[-1] < f32[0] - 1.0  # it learns
    assert abs(np.mean(bf16[-10:]) - np.mean(f32[-10:])) < BF16_LOSS_DISTANCE
    assert bf16 != f32  # and it really ran in bf16


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
import tinyllm
tinyllm.enable_compilation_cache()
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
