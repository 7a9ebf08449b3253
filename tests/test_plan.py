"""--plan (model/accelerators/plan.py, model/plan_stage.py): its bytes agree with XLA's own
memory analysis of the compiled step, FSDP's share is counted per device, FLOPs and step time
follow their formulas, and --train refuses on an accelerator what the plan says cannot fit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from configs.schema import load_config, resolve_config_path
from model.accelerators.devices import NAMES, accelerator, accelerator_of_kind
from model.accelerators.plan import make_plan, planned_config
from model.processes.cpu_kernels import YNN_FUSION_FLAG
from plumbing.errors import UsageError
from tests.child_env import child_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def jax_default_gpu_share(monkeypatch):
    """The plans below assume JAX's default share of a GPU's memory (75%): the suite itself
    turns preallocation off where it runs on a GPU (tests/conftest.py)."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)


def config(name: str, *overrides: str):
    return planned_config(load_config(resolve_config_path(name), list(overrides)))


def xla_bytes(cfg) -> int:
    """What XLA's buffer assignment gives one device for the compiled train step: arguments
    and outputs (the donated state counted once) and temporaries."""
    from model.training.trainer import Trainer

    trainer = Trainer(cfg.train, cfg.model, abstract=True)
    x, y = trainer.batch_shapes()
    traced = trainer.train_step.trace(trainer.initial_state(), x, y)
    m = traced.lower().compile().memory_analysis()
    out = m.output_size_in_bytes - m.alias_size_in_bytes
    return m.argument_size_in_bytes + out + m.temp_size_in_bytes


# Five recipes and shapes: the demo (Muon, QK-norm, x0 mixing), nanoGPT's char config (AdamW),
# gradient accumulation, Llama's layers, mixture of experts.
# Two layers each: what is counted per layer is the same, and XLA compiles them sooner.
AGREEING = [
    ("shakespeare", "model.n_layer=2"),
    ("shakespeare_char", "model.n_layer=2"),
    ("shakespeare_char", "model.n_layer=2", "train.batch_size=32", "train.grad_accum=2"),
    ("shakespeare", "model.n_layer=2", "model.mlp=swiglu", "model.position=rope",
     "model.norm=rmsnorm"),
    ("shakespeare", "model.n_layer=2", "model.moe_experts=4", "train.optimizer=adamw",
     "train.normuon=false"),
]  # fmt: skip


@pytest.mark.parametrize("case", AGREEING, ids=lambda c: " ".join(c))
def test_plan_bytes_agree_with_xla_memory_analysis(case):
    cfg = config(*case)
    plan = make_plan(cfg, accelerator("cpu"), devices=1)
    ratio = plan.bytes_per_device["total"] / xla_bytes(cfg)
    # With XLA's own dot kernels (AVX2: model/processes/cpu_kernels.py) XLA needs 10-15% fewer
    # temporaries than with YNNPACK's, which the plan follows: there it may over-count more.
    own_kernels = YNN_FUSION_FLAG in os.environ.get("XLA_FLAGS", "")
    assert 0.8 <= ratio <= (1.25 if own_kernels else 1.2), ratio


def test_fsdp_is_counted_per_device_on_four_devices():
    """Run under 4 CPU devices: the plan per device for data parallel and FSDP, against XLA's
    per-device memory analysis; FSDP holds a quarter of the matrices' state."""
    script = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
from tests.test_plan import config, xla_bytes
from model.accelerators.devices import accelerator
from model.accelerators.plan import make_plan
out = {{}}
for fsdp in ("false", "true"):
    cfg = config("shakespeare", "model.n_layer=2", "train.fsdp=" + fsdp)
    plan = make_plan(cfg, accelerator("cpu"), devices=4)
    out[fsdp] = [plan.bytes_per_device, xla_bytes(cfg) if fsdp == "true" else None]
print(json.dumps(out))
"""
    env = child_env(devices=4)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (dp, _), (fsdp, xla) = out["false"], out["true"]
    assert 0.8 <= fsdp["total"] / xla <= 1.2, (fsdp, xla)
    for part in ("parameters", "gradients", "optimizer"):
        assert fsdp[part] < 0.3 * dp[part], part  # all but norms and scalars split in 4
    assert fsdp["activations"] == dp["activations"]  # the batch is split either way


def test_flops_step_time_and_the_device_table():
    assert {"h100-sxm", "h100-pcie", "h200", "a100-40gb", "a100-80gb", "l4"} <= set(NAMES)
    assert {"tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "cpu"} <= set(NAMES)
    assert accelerator_of_kind("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert accelerator_of_kind("TPU v5 lite").name == "tpu-v5e"
    assert accelerator_of_kind("NVIDIA L40S") is None  # not guessed from a longer name
    cfg = config("gpt2_124m")
    plan = make_plan(cfg, accelerator("h100-sxm"))
    n, layers, width, context = 124_337_664, 12, 768, 1024
    assert plan.params == n  # GPT-2 small, tied head
    non_embedding = n - context * width  # the position table does no matmul
    assert plan.flops_per_token == 6 * non_embedding + 12 * layers * width * context
    tokens = cfg.train.batch_size * context
    expected = plan.flops_per_token * tokens / (989e12 * 0.4)
    assert plan.step_seconds == pytest.approx(expected)
    assert plan.attention == "cudnn" and plan.fits
    on_tpu = make_plan(cfg, accelerator("tpu-v5e"))
    assert on_tpu.attention == "xla"  # no cuDNN: T x T probabilities kept
    assert on_tpu.bytes_per_device["activations"] > plan.bytes_per_device["activations"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tinyllm.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def plan_in_process(capsys, *args: str) -> str:
    """tinyllm.py --plan ARGS in this process (no JAX start-up to pay); its stdout."""
    import tinyllm

    assert tinyllm.main(["--plan", *args]) == 0
    return capsys.readouterr().out


def test_plan_says_may_fit_where_train_starts_with_a_note(capsys):
    """GPT-2 small on a 40 GB A100's 30 GiB share: over the plan's 37.2 GiB, within the state
    and half its activations (19.5 GiB), as --train judges it; a TPU's plan stands."""
    lines = plan_in_process(capsys, "--config", "gpt2_124m", "--device", "a100-40gb")
    [total] = [line for line in lines.splitlines() if line.split()[0] == "total"]
    assert "MAY FIT (with half the activations; --train starts)" in total
    plan = json.loads(
        plan_in_process(capsys, "--json", "--config", "gpt2_124m", "--device", "a100-40gb")
    )
    assert plan["fits"] is False and plan["may_fit"] is True
    tpu = json.loads(
        plan_in_process(capsys, "--json", "--config", "gpt2_124m", "--device", "tpu-v5e")
    )
    assert tpu["fits"] is False and tpu["may_fit"] is False


def test_cli_plan_json_and_text(capsys):
    plan = json.loads(
        plan_in_process(capsys, "--json", "--config", "gpt2_124m", "--device", "tpu-v5e")
    )
    assert {"params", "flops_per_token", "bytes_per_device", "fits"} <= set(plan)
    assert plan["device"]["name"] == "tpu-v5e" and plan["fits"] is False  # 16 GiB
    assert plan["bytes_per_device"]["total"] > 16 * 2**30
    verdicts = {}
    for batch in (32, 64):  # 4 or 8 sequences on each of 8 chips
        lines = plan_in_process(
            capsys, "--config", "gpt2_124m", "--device", "tpu-v5e", "--devices", "8",
            "train.fsdp=true", f"train.batch_size={batch}",
        ).splitlines()  # fmt: skip
        assert lines[0].startswith("plan: gpt2_124m on 8 x TPU v5e")
        assert any("(adamw, FSDP)" in line for line in lines)
        [total] = [line for line in lines if line.split()[0] == "total"]
        verdicts[batch] = total.split("  ")[-1].split(" in ")[0].strip()
    assert verdicts == {32: "fits", 64: "DOES NOT FIT"}


def test_plan_of_a_run_without_config_is_the_runs_own_model(tmp_path, capsys):
    # --plan --out RUN planned the default config file's model, whatever RUN held
    import tinyllm

    shape = ["model.n_layer=2", "model.n_embd=64", "tokenizer.vocab_size=500"]
    saved = load_config(resolve_config_path(None), shape).to_dict()
    saved["model"]["vocab_size"] = 500  # as training saves it
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(saved))
    assert tinyllm.main(["--plan", "--json", "--device", "h100-sxm", "--out", str(run_dir)]) == 0
    out, _ = capsys.readouterr()
    elsewhere = ["--json", "--device", "h100-sxm", "--out", str(tmp_path / "none")]
    same_shape = plan_in_process(capsys, *elsewhere, *shape)
    default = plan_in_process(capsys, *elsewhere)
    assert json.loads(out)["params"] == json.loads(same_shape)["params"]
    assert json.loads(out)["params"] != json.loads(default)["params"]


def test_cli_plan_refuses_bad_devices_in_one_line(tmp_path):
    proc = run_cli("--plan", "--device", "tpu-v9")
    assert proc.returncode == 2
    assert proc.stderr.startswith("tinyllm: error: --device must be one of h100-pcie, h100-sxm")
    assert len(proc.stderr.splitlines()) == 1
    proc = run_cli("--train", "--device", "h100-sxm")
    assert proc.returncode == 2 and "go with --plan" in proc.stderr
    proc = run_cli("--plan", "--config", "gpt2_124m", "--device", "h100-sxm", "--devices", "5")
    assert proc.returncode == 2 and "divide evenly over the 5 devices" in proc.stderr


class FakeGPU:
    """What check_training_memory asks of a device: its platform and free memory."""

    platform = "gpu"

    def __str__(self):
        return "cuda:0"


def test_train_refuses_on_an_accelerator_what_the_plan_says_cannot_fit(monkeypatch):
    import model.training.memory as memory
    from model.accelerators.gpu_host import traced_as

    monkeypatch.setattr(jax, "local_devices", lambda: [FakeGPU()])
    monkeypatch.setattr(memory, "available_bytes", lambda device: 8 * 2**30)
    cfg = config("gpt2_124m")  # about 37 GiB by the plan, against 8 GiB free
    with traced_as("cuda"), pytest.raises(UsageError) as refused:  # the model sees an H100
        memory.check_training_memory(cfg.model, cfg.train)
    line = str(refused.value)
    assert line.startswith("this model needs about ") and "--plan shows the plan" in line
    assert "free memory on cuda:0" in line and "\n" not in line
    assert "at least 19.5 GiB" in line  # the state and half the plan's activations
    small = config("shakespeare_char")
    with traced_as("cuda"):
        memory.check_training_memory(small.model, small.train)  # fits: no error


def test_train_starts_with_a_note_where_only_the_plans_activations_do_not_fit(monkeypatch, capsys):
    """24 GiB free: under the plan's 37.2 GiB but over the state and half its activations
    (XLA on an H200 kept 0.54 of the plan's): the run starts, with one line saying so."""
    import model.training.memory as memory
    from model.accelerators.gpu_host import traced_as

    monkeypatch.setattr(jax, "local_devices", lambda: [FakeGPU()])
    monkeypatch.setattr(memory, "available_bytes", lambda device: 24 * 2**30)
    cfg = config("gpt2_124m")
    with traced_as("cuda"):
        memory.check_training_memory(cfg.model, cfg.train)
    note = capsys.readouterr().err
    assert note.startswith("train: note: the plan says about 37.2 GiB to train")
    assert "more than the 24.0 GiB of free memory on cuda:0" in note
    assert note.count("\n") == 1


def test_cpu_devices_share_the_machines_rate(capsys):
    # Forced host devices split the same cores: more of them make no step faster.
    def step_seconds(devices: int) -> float:
        argv = ["--json", "--config", "gpt2_124m", "--device", "cpu", "--devices", str(devices)]
        return json.loads(plan_in_process(capsys, *argv))["step_seconds"]

    one, four = step_seconds(1), step_seconds(4)  # the rate is measured once a process
    assert four == pytest.approx(one, rel=1e-9)
