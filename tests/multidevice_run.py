"""A few train steps on however many devices JAX sees; run as a script under XLA_FLAGS.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/multidevice_run.py \
        CONFIG RUN_DIR '["key=value", ...]'

prints one JSON line: device count, per-step losses for data-parallel and FSDP training, and
how the last batch was laid out over the devices.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def short_run(config: str, run_dir: str, overrides: list[str], steps: int = 6) -> dict:
    import jax

    from configs.schema import load_config
    from model.training.data import load_token_splits
    from model.training.trainer import Trainer
    from tokenizer import load_tokenizer
    from tokenizer.corpus import corpus_for

    out: dict = {"devices": jax.device_count()}
    tok_path = Path(run_dir) / "tokenizer.pkl"
    tok = load_tokenizer(tok_path)
    for fsdp in (False, True):
        cfg = load_config(config, [*overrides, f"train.fsdp={str(fsdp).lower()}"])
        splits = load_token_splits(corpus_for(cfg.data), tok, tok_path, Path(run_dir), 0.1)
        trainer = Trainer(cfg.train, cfg.model.for_vocab(tok.vocab_size))
        losses = []
        for step in range(steps):
            x, y = trainer.batch(splits.train, step)
            trainer.params, trainer.opt_state, metrics = trainer.train_step(
                trainer.params, trainer.opt_state, x, y, step
            )
            losses.append(float(metrics["loss"]))
        out["fsdp" if fsdp else "data_parallel"] = losses
        kernel = jax.tree_util.tree_leaves(trainer.params)[0]
        out["fsdp_param_shards" if fsdp else "dp_param_shards"] = len(
            {str(s.index) for s in kernel.addressable_shards}
        )
    out["batch_shards"] = sorted({str(s.index) for s in x.addressable_shards})
    out["batch_shard_rows"] = [s.data.shape[1] for s in x.addressable_shards]
    return out


if __name__ == "__main__":
    print(json.dumps(short_run(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
