"""Sampling in each process of a multi-process JAX job; run as a script under JAX's variables.

    JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i \
        python tests/multihost_sampling.py RUN_DIR

Every process opens the trained run, samples greedily through --inference's programs and
through a serving engine, and prints one JSON line: its process index, the tokens and the text.
Each process may only address its own devices: jax.devices()[0] is process 0's.
"""

import json
import queue
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(run_dir: str) -> dict:
    from model.processes.distributed import initialize_from_env

    assert initialize_from_env(), "not a multi-process launch"
    import jax

    from model.decoding.generate import generate_all
    from model.decoding.sampling_params import SamplingParams
    from model.rundir.trained import open_trained_run
    from model.serving.engine import Engine
    from model.serving.requests import Request

    tokenizer, model, _ = open_trained_run(run_dir).load()
    prompt = tokenizer.encode("to be or")
    tokens = generate_all(model, prompt, max_new_tokens=8, temperature=0.0)
    events: queue.Queue = queue.Queue()
    engine = Engine(model, tokenizer, rows=2, queue_size=2)
    engine.start()
    engine.submit(
        Request(prompt, 8, lambda kind, data: events.put((kind, data)), SamplingParams(0.0))
    )
    text = ""
    while True:
        kind, data = events.get(timeout=120)
        if kind == "text":
            text += data
        elif kind == "done":
            break
        else:
            raise RuntimeError(f"engine: {data}")
    engine.stop()
    return {
        "process": jax.process_index(),
        "devices": jax.device_count(),
        "tokens": tokens[0].tolist(),
        "text": text,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
