"""EleutherAI's lm-evaluation-harness scores a served run: the real `lm_eval` CLI, its
`local-completions` model with the server's own tokenizer (`tokenizer_backend=remote`), on a
small multiple-choice task written here. Its accuracy and every choice's log-likelihood must
equal what the model's own forward pass gives; the shared contexts hit the prefix cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("starlette")

from model.rundir.trained import open_trained_run
from tests.serve_helpers import ServerProcess
from tests.tiny_models import forward
from tests.tiny_runs import train_tiny_run

DOCS = [
    {"context": "to be or", "choices": [" not", " yes", " maybe"], "gold": 0},
    {"context": "the question", "choices": [" is", " was"], "gold": 1},
    {"context": "whether tis", "choices": [" nobler", " not", " the"], "gold": 0},
    {"context": "or not to", "choices": [" be", " see"], "gold": 0},
    {"context": "that is", "choices": [" the", " a", " to"], "gold": 2},
    {"context": "in the mind", "choices": [" to", " of"], "gold": 1},
]
TASK = """task: tinyllm_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
"""


def loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """What lm-eval asks for: log p(continuation | context), tokenized as it tokenizes
    (the whole text, split where the context's own tokens end)."""
    whole = tokenizer.encode(context + continuation)
    n_ctx = len(tokenizer.encode(context))
    logits = forward(model, jnp.asarray([whole], jnp.int32))[0]
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    return float(sum(logp[i - 1, whole[i]] for i in range(n_ctx, len(whole))))


def test_lm_eval_scores_a_served_run_as_its_own_forward_pass(tmp_path):
    run_dir = train_tiny_run(
        tmp_path, "tokenizer.vocab_size=270", "model.block_size=32", "train.max_steps=12",
        config="shakespeare",
    )  # fmt: skip
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tinyllm_mc.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "results"
    with ServerProcess(run_dir, "serve.batch_size=4") as server:
        args = (
            f"model=tinyllm,base_url={server.url}/v1/completions,tokenizer_backend=remote,"
            "max_length=32,num_concurrent=1,max_retries=1"
        )
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(
            [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
             "--model_args", args, "--tasks", "tinyllm_mc", "--include_path", str(tasks),
             "--output_path", str(out), "--log_samples"],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        metrics = httpx.get(server.url + "/metrics").text
    tokenizer, model, _ = open_trained_run(run_dir).load()
    ours = [[loglikelihood(model, tokenizer, d["context"], c) for c in d["choices"]] for d in DOCS]
    expected_acc = np.mean(
        [int(np.argmax(lls)) == d["gold"] for lls, d in zip(ours, DOCS, strict=True)]
    )
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    assert results["results"]["tinyllm_mc"]["acc,none"] == pytest.approx(expected_acc)
    samples = [json.loads(line) for line in next(out.rglob("samples_*.jsonl")).open()]
    for sample in samples:
        theirs = [float(r[0]) for r in sample["filtered_resps"]]
        np.testing.assert_allclose(theirs, ours[sample["doc_id"]], atol=1e-4)
    hits = [line for line in metrics.splitlines() if line.startswith("tinyllm_prefix_cache_hits")]
    # lm-eval orders requests by length, not by document, so only some choices meet a row
    # that still holds their context
    assert float(hits[0].split()[1]) >= 1
