"""tinyllm's model library, one room per job, and the three stages built on it.

    train_stage.py      --train: the run's tokenizer and corpus -> trained checkpoints
    inference_stage.py  --inference: a trained run -> text streamed to stdout
    serve_stage.py      --serve: a trained run -> an OpenAI-compatible HTTP server
    plan_stage.py       --plan: what a config costs on a device, before anything compiles
    network/            the GPT: config, embeddings, attention, MLPs, mixture of experts
    training/           train settings, token cache, compiled step, loop, metrics, resume
    decoding/           sample settings, KV-cache decoding, its compiled programs and cache
    rundir/             the run directory: file layout, lock, checkpoints, opening a trained run
    processes/          devices and meshes, several processes and hosts
    quantization/       int8/int4 weights: the math, the quantized file, quantizing a run
    interop/            Hugging Face checkpoints in and out (GPT-2, Llama, Qwen3)
    serving/            the HTTP server: continuous batching, OpenAI's API, the playground
    accelerators/       GPUs and TPUs from a CPU: the device table, the plan, lowering checks

Example:
    >>> from flax import nnx
    >>> from model import GPT, ModelConfig, generate_all
    >>> model = GPT(ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32),
    ...             rngs=nnx.Rngs(0))
    >>> generate_all(model, [1, 2, 3], max_new_tokens=4, temperature=0).shape
    (1, 4)
"""

from plumbing.lazy import exports_on_first_use

# Exports load on first use, so that model.network.config (which every config load needs)
# and the other small modules import without pulling in JAX and Flax.
_EXPORTS = {
    "GPT": "model.network.gpt",
    "KVCache": "model.network.gpt",
    "count_params": "model.network.gpt",
    "flops_per_token": "model.network.gpt",
    "ModelConfig": "model.network.config",
    "PAD_ID": "model.decoding.steps",
    "generate": "model.decoding.generate",
    "generate_all": "model.decoding.generate",
    "sample_logits": "model.decoding.sampling",
}

__all__ = sorted(_EXPORTS)

__getattr__ = exports_on_first_use(__name__, _EXPORTS)
