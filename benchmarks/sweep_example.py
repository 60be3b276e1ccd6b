"""The worked sweep: learning rate x entropy coefficient on CartPole-v1 with its velocities hidden,
with memory, 4 seeds per configuration, all in one compiled program.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/sweep_example.py
    python benchmarks/sweep_example.py --plot   # the plot again, from the CSV

It trains what `python ppo_nnx_vae_lstm.py` trains with FLAGS, through the script's own functions
(`run`, `evaluate`, `sweep_table`), and keeps every run's curve. It writes, in results/:
sweep_example.md (the command's table, wall times), sweep_example.csv (each run's episodic return
by global step) and sweep_example.png (each configuration's mean over its seeds, their range
shaded).
"""

import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from common import describe, machine, versions

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FLAGS = (
    "--env-id CartPole-v1 --mask-velocity --lstm-size 64 --total-timesteps 500000 "
    "--num-seeds 4 --eval-episodes 100 --eval-deterministic "
    "--sweep learning-rate=3e-4,1e-3,3e-3 ent-coef=0,0.01"
)


def latest(returns: np.ndarray) -> np.ndarray:
    """[run, iteration] episodic returns, an iteration where no episode ended keeping the last."""
    index = np.where(np.isnan(returns), 0, np.arange(returns.shape[1]))
    return np.take_along_axis(returns, np.maximum.accumulate(index, axis=1), axis=1)


def smooth(curves: np.ndarray, window: int) -> np.ndarray:
    """A moving mean over `window` iterations, along the last axis."""
    kernel = np.ones(window) / window
    return np.stack([np.convolve(c, kernel, mode="valid") for c in curves])


def plot(csv: Path, png: Path) -> None:
    """From the CSV alone: each configuration's mean over its seeds, the seeds' range shaded,
    every run smoothed over 2% of the iterations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header, *rows = csv.read_text().splitlines()
    names = header.split(",")[1:]
    table = np.array([[float(x or "nan") for x in row.split(",")] for row in rows])
    steps, returns = table[:, 0], latest(table[:, 1:].T)
    window = max(1, len(steps) // 50)
    configs = list(dict.fromkeys(name.split(" seed ")[0] for name in names))
    figure, axes = plt.subplots(figsize=(7, 4.5))
    with warnings.catch_warnings():  # before any episode ended: NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        for config in configs:
            runs = [i for i, name in enumerate(names) if name.startswith(config + " ")]
            curves = smooth(returns[runs], window)
            x = steps[window - 1 :]
            line = axes.plot(x, np.nanmean(curves, 0), label=config)
            low, high = np.nanmin(curves, 0), np.nanmax(curves, 0)
            axes.fill_between(x, low, high, color=line[0].get_color(), alpha=0.12)
    axes.set(xlabel="global_step", ylabel="episodic_return, mean of the seeds")
    axes.set_title("ppo_nnx_vae_lstm.py --sweep, CartPole-v1 with velocities masked")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(png, dpi=100)


def main():
    if sys.argv[1:] == ["--plot"]:  # again, from the CSV
        return plot(RESULTS / "sweep_example.csv", RESULTS / "sweep_example.png")
    sys.path.insert(0, str(ROOT))
    import jax
    import tyro

    import ppo_nnx_vae_lstm as script

    args = script.check_args(tyro.cli(script.Args, args=FLAGS.split()))
    begin = time.time()
    state, metrics, compile_s, (train_s,) = script.run(args)
    params, norm = jax.tree.map(np.asarray, (state.params, state.runner.norm))
    returns = script.evaluate(args, params, norm)
    wall_s = time.time() - begin
    table = script.sweep_table(args, script.final_return(metrics), returns)
    print(table)

    steps = metrics["global_step"][0]
    episodic = np.asarray(metrics["charts/episodic_return"])
    # "learning-rate=0.001 ent-coef=0 seed 1": no comma inside a CSV column's name
    names = [f"{script.config_name(c)} seed {seed}" for c, seed in args.members]
    names = [name.replace(",", " ") for name in names]
    rows = ["global_step," + ",".join(names)]
    rows += [
        f"{step}," + ",".join(f"{x:.2f}" for x in column)
        for step, column in zip(steps, episodic.T)
    ]
    (RESULTS / "sweep_example.csv").write_text("\n".join(rows) + "\n")
    plot(RESULTS / "sweep_example.csv", RESULTS / "sweep_example.png")

    xla = os.environ.get("XLA_FLAGS")
    (RESULTS / "sweep_example.md").write_text(
        "\n".join(
            [
                "# A sweep: learning rate x entropy coefficient, with memory",
                "",
                "`"
                + (f"XLA_FLAGS={xla} " if xla else "")
                + "python benchmarks/sweep_example.py`, on "
                + f"{describe(machine(), versions())}. It trains, in one process,",
                "",
                "```bash",
                f"python ppo_nnx_vae_lstm.py {FLAGS}",
                "```",
                "",
                f"{len(args.configs)} configurations x {args.num_seeds} seeds = "
                f"{len(args.members)} runs of {args.num_iterations * args.batch_size:,} "
                f"env steps, in {wall_s:.0f} s (compile {compile_s:.0f} s, training "
                f"{train_s:.0f} s, then 100 deterministic evaluation episodes per run). "
                "final_episodic_return: the mean training return over the last 5% of "
                "iterations.",
                "",
                *table.splitlines()[1:],
                "",
                "Curves: [sweep_example.png](sweep_example.png) (each configuration's mean "
                "over its seeds, their range shaded); every run's: "
                "[sweep_example.csv](sweep_example.csv).",
            ]
        )
        + "\n"
    )
    print(f"-> {RESULTS / 'sweep_example.md'}")


if __name__ == "__main__":
    main()
