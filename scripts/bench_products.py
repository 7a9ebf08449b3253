"""How much decoding several rows at once can gain on this CPU: a run's dense products alone.

A decode step of one row reads every weight once for a few FLOPs each, so it is bound by the
memory; N rows share that read and multiply N times as much. The ratio of N rows' products
to one row's is then the most that batching N requests can gain here, before attention,
sampling and the server take their share (docs/serving.md, "Measured"). This times the run's
own dense products in a step's order (each block's Linear kernels, then the output layer),
chained so that each waits for the one before, as in a step:

- by XLA, jitted, as `--serve` runs them (XLA's own kernels on AVX2 CPUs, as it picks);
- by numpy (its BLAS), as a peer;
- and one large product (2,048 cubed) by numpy: this CPU's arithmetic at its best.

Medians of `--repeats` calls after a warm-up. Time it alone:

    python scripts/bench_products.py --run runs/bpe11m
    python scripts/bench_products.py --run runs/bpe11m --rows 1 2 4 8 16 64
"""

from __future__ import annotations

import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone, uninstalled

from plumbing.cli import OneLineParser, one_line_errors
from plumbing.machine import machine_line

PEAK_SIZE = 2048


def step_kernels(model) -> list:
    """The float32 [in, out] matrices a decode step multiplies by, in order: the blocks'
    Linear kernels, then the output layer (the tied embedding as [width, vocab])."""
    import jax
    import numpy as np
    from flax import nnx

    params = nnx.state(model, nnx.Param)
    kernels = [
        np.asarray(leaf, np.float32)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if "blocks" in jax.tree_util.keystr(path) and np.ndim(leaf) == 2
    ]
    tied = model.lm_head is None
    head = model.wte.embedding[...].T if tied else model.lm_head.kernel[...]
    return [*kernels, np.asarray(head, np.float32)]


def chained(matmul, pad, x, kernels):
    """x by each kernel in turn, each input cut (or zero-padded) from the output before."""
    for w in kernels:
        k = w.shape[0]
        x = matmul(x[:, :k] if x.shape[1] >= k else pad(x, k), w)
    return x


def median_seconds(call, repeats: int) -> float:
    call()  # compiled, warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = OneLineParser(prog="bench_products.py", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a trained run directory")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=30, help="calls; the table shows medians")
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.repeats < 1:
        p.error("--rows and --repeats must be >= 1")

    with one_line_errors("bench_products"):
        from model.processes.cpu_kernels import configure_cpu_kernels

        configure_cpu_kernels()  # as `--serve` does, before JAX starts its backend
        import jax
        import jax.numpy as jnp
        import numpy as np

        from model.rundir.trained import load_for_sampling

        _, model = load_for_sampling(Path(args.run), None, None)
        kernels = step_kernels(model)
        on_device = [jnp.asarray(w) for w in kernels]
        flops_per_row = 2 * sum(w.size for w in kernels)
        megabytes = sum(w.nbytes for w in kernels) / 1e6

        def np_pad(x, k):
            return np.pad(x, ((0, 0), (0, k - x.shape[1])))

        def jnp_pad(x, k):
            return jnp.pad(x, ((0, 0), (0, k - x.shape[1])))

        xla_chain = jax.jit(lambda x, ws: chained(jnp.matmul, jnp_pad, x, ws))
        command = shlex.join(["scripts/bench_products.py", *(argv or sys.argv[1:])])
        print("command: python " + command)
        print(machine_line())
        print(f"{Path(args.run).name}: {len(kernels)} products a step, {megabytes:.1f} MB of "
              f"float32 weights, {flops_per_row / 1e6:.1f} MFLOP a row; JAX "
              f"{jax.default_backend()}; medians of {args.repeats}\n")  # fmt: skip
        print("| rows | XLA: ms | GFLOP/s | numpy: ms | GFLOP/s |")
        print("|---:|---:|---:|---:|---:|")
        xla_ms = {}
        rng = np.random.default_rng(0)
        for rows in args.rows:
            x = rng.standard_normal((rows, kernels[0].shape[0]), dtype=np.float32)
            x_dev = jnp.asarray(x)
            xla = median_seconds(
                lambda x_dev=x_dev: xla_chain(x_dev, on_device).block_until_ready(), args.repeats
            )
            host = median_seconds(lambda x=x: chained(np.matmul, np_pad, x, kernels), args.repeats)
            xla_ms[rows] = 1e3 * xla
            gflops = [rows * flops_per_row / s / 1e9 for s in (xla, host)]
            print(f"| {rows} | {1e3 * xla:.3f} | {gflops[0]:.1f} | {1e3 * host:.3f} | "
                  f"{gflops[1]:.1f} |")  # fmt: skip
        a = rng.standard_normal((PEAK_SIZE, PEAK_SIZE), dtype=np.float32)
        peak = median_seconds(lambda: a @ a, max(3, args.repeats // 5))
        print(f"\nthis CPU at its best: numpy's {PEAK_SIZE}-cubed product, "
              f"{2 * PEAK_SIZE**3 / peak / 1e9:.0f} GFLOP/s")  # fmt: skip
        one = xla_ms.get(1)
        for rows in args.rows:
            if one and rows > 1:
                print(f"{rows} rows' products take {xla_ms[rows] / one:.2f}x one row's (XLA): "
                      f"batching {rows} rows gains at most {rows * one / xla_ms[rows]:.1f}x "
                      "here, before attention and sampling")  # fmt: skip


if __name__ == "__main__":
    main()
