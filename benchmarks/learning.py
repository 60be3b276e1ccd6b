"""Learning curves of ppo_nnx.py and ppo_nnx_vae_lstm.py, beside published figures.

    pip install -r benchmarks/requirements.txt
    python benchmarks/learning.py                             # every run (see benchmarks/README)
    python benchmarks/learning.py --only Acrobot-v1           # the runs of one env, or by name
    python benchmarks/learning.py --quick --out /tmp/smoke    # two iterations each: a smoke run

Each run trains SEEDS seeds of one script on one env in one compiled program (`--num-seeds`,
a vmap over seeds), in a process of its own. Everything a run does is in its flags below, which
are the script's own CLI flags, so every row is reproduced by one `python <script>.py ...`
command (printed in the table). Writes, under results/: <env>.csv (every seed's episodic return
at every iteration), <env>.png (mean and a band over seeds), learning.json (merged across
invocations, so `--only` reruns just some rows) and the table learning.md.
"""

import argparse
import datetime
import importlib.util
import json
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from speed import describe, machine, versions
from stress import watch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SEEDS = 8

# After RL Zoo's PPO settings for Pendulum (4 envs x 1024 steps, 10 epochs, gamma 0.9).
PENDULUM = ("--env-id Pendulum-v1 --total-timesteps 1000000 --num-envs 4 --num-steps 1024 "
            "--update-epochs 10 --learning-rate 1e-3 --gamma 0.9 --ent-coef 0")
# PureJaxRL's MinAtar settings (64 envs x 128 steps, 8 minibatches, lr 5e-4), 10M steps.
MINATAR = ("--total-timesteps 10000000 --num-envs 64 --num-steps 128 --num-minibatches 8 "
           "--learning-rate 5e-4")
# Run name ("<script> <env id>[ masked]") -> the script's CLI flags. Tuned per env, never the
# algorithm per env. The masked rows hide velocities: a feed-forward policy cannot do them.
RUNS = {
    "ppo_nnx CartPole-v1": "--env-id CartPole-v1",  # CleanRL's ppo.py defaults, 500k steps
    "ppo_nnx Acrobot-v1": "--env-id Acrobot-v1 --total-timesteps 1000000",
    "ppo_nnx Pendulum-v1": PENDULUM,
    "ppo_nnx MountainCarContinuous-v0": (
        "--env-id MountainCarContinuous-v0 --total-timesteps 1000000"),
    "ppo_nnx Breakout-MinAtar": f"--env-id Breakout-MinAtar {MINATAR}",
    "ppo_nnx SpaceInvaders-MinAtar": f"--env-id SpaceInvaders-MinAtar {MINATAR}",
    "ppo_nnx CartPole-v1 masked": "--env-id CartPole-v1 --mask-velocity --total-timesteps 1000000",
    "ppo_nnx Pendulum-v1 masked": f"{PENDULUM} --mask-velocity",
    "ppo_nnx_vae_lstm CartPole-v1": "--env-id CartPole-v1",  # the recurrent defaults, 1M steps
    "ppo_nnx_vae_lstm CartPole-v1 masked": "--env-id CartPole-v1 --mask-velocity",
    "ppo_nnx_vae_lstm Pendulum-v1 masked": f"{PENDULUM} --mask-velocity --num-minibatches 4",
}

# Final mean return over seeds that a run should reach (the targets).
TARGETS = {
    "ppo_nnx CartPole-v1": 490,
    "ppo_nnx Acrobot-v1": -85,
    "ppo_nnx Pendulum-v1": -200,
    "ppo_nnx Breakout-MinAtar": 28,
    "ppo_nnx SpaceInvaders-MinAtar": 131,
}

# Published figures by env (masked: "<env id> masked"), and where each comes from.
REFERENCES = {
    "CartPole-v1": ["CleanRL 490.04 ± 6.12", "gymnax 500", "PureJaxRL about 500"],
    "Acrobot-v1": ["CleanRL -86.36 ± 1.32", "gymnax -80"],
    "Pendulum-v1": ["gymnax -130"],
    "MountainCarContinuous-v0": ["gymnax 92"],
    "Breakout-MinAtar": ["gymnax 28"],
    "SpaceInvaders-MinAtar": ["gymnax 131"],
    "CartPole-v1 masked": ["SB3 RL Zoo 500 ± 0"],
}
SOURCES = {
    "CleanRL": "CleanRL's docs for ppo.py (500k steps; Acrobot likewise)",
    "gymnax": "the gymnax README's table of its PPO checkpoints (budgets not stated)",
    "PureJaxRL": "the PureJaxRL README's CartPole plot (500k steps)",
    "SB3 RL Zoo": "SB3 RecurrentPPO on CartPoleNoVel-v1 (velocities removed), model card "
                  "huggingface.co/sb3/ppo_lstm-CartPoleNoVel-v1",
}


def script_of(name: str) -> str:
    return name.split()[0]


def env_of(name: str) -> str:
    return name.split()[1]


def command_of(name: str) -> str:
    return f"python {script_of(name)}.py {RUNS[name]} --num-seeds {SEEDS}"


# ----------------------------------------------------------------------------------------------
# Worker: one run, in this process
# ----------------------------------------------------------------------------------------------
def worker(name: str, quick: bool, out_file: Path) -> None:
    """Train SEEDS seeds at once, as `command_of(name)` does, and save every iteration."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import tyro

    sys.path.insert(0, str(ROOT))
    script = importlib.import_module(script_of(name))
    args = tyro.cli(script.Args, args=shlex.split(RUNS[name]) + ["--num-seeds", str(SEEDS)])
    if quick:
        args = dataclasses.replace(args, total_timesteps=2 * args.batch_size, num_seeds=2)
    seeds = args.seed + np.arange(args.num_seeds)  # as the script's main draws them
    keys = jax.vmap(jax.random.key)(jnp.asarray(seeds))
    start = time.perf_counter()
    train = jax.jit(jax.vmap(script.make_train(args)))
    compiled = train.lower(keys, jnp.arange(args.num_seeds)).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    _, metrics = jax.block_until_ready(compiled(keys, jnp.arange(args.num_seeds)))
    train_s = time.perf_counter() - start
    np.savez(out_file, seeds=seeds, global_step=np.asarray(metrics["global_step"][0]),
             returns=np.asarray(metrics["charts/episodic_return"]),
             final=script.final_return(metrics), compile_s=compile_s, train_s=train_s)


# ----------------------------------------------------------------------------------------------
# Driver: one process per run, then CSVs, plots and the table from everything measured so far
# ----------------------------------------------------------------------------------------------
def run(name: str, quick: bool, timeout_s: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out_file = Path(folder) / "run.npz"
        command = [sys.executable, __file__, "--worker", name, "--worker-out", str(out_file)]
        done = watch(command + ["--quick"] * quick, idle_timeout=60, limit=timeout_s)
        if done["outcome"] == "failed":
            return dict(error=done["last_line"] or f"exit code {done['exit_code']}")
        if done["outcome"] != "ok":  # hung (no CPU for 60 s) or too slow
            return dict(error=f"{done['outcome']} after {done['wall_s']} s")
        data = dict(np.load(out_file))
    final = data["final"]
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        cpu=machine()["cpu"], quick=quick, command=command_of(name), seeds=data["seeds"].tolist(),
        steps_per_seed=int(data["global_step"][-1]), final=[round(float(r), 2) for r in final],
        mean=float(final.mean()), std=float(final.std()),
        compile_s=float(data["compile_s"]), train_s=float(data["train_s"]),
        curves=(data["global_step"], data["returns"]))


def save_curves(path: Path, name: str, global_step, returns) -> None:
    """Put one run's lines into its env's CSV, replacing that run's old lines and no others.

    A line per (run, iteration): the episodic return of every seed (empty: no episode ended).
    """
    rows = [line.split(",") for line in path.read_text().splitlines()[1:]] if path.exists() else []
    rows = [row for row in rows if row[0] != name]
    for step, values in zip(global_step, np.asarray(returns, dtype=float).T):
        rows.append([name, str(step)] + ["" if np.isnan(v) else f"{v:.2f}" for v in values])
    if not rows:
        path.unlink(missing_ok=True)
        return
    seeds = max(len(row) for row in rows) - 2
    header = ["run", "global_step"] + [f"seed_{i}" for i in range(seeds)]
    lines = [",".join(row + [""] * (seeds + 2 - len(row))) for row in [header] + rows]
    path.write_text("\n".join(lines) + "\n")


def load_curves(path: Path) -> dict:
    """run name -> (global_step [I], returns [seed, I]) from an env's CSV."""
    rows = {}
    for line in path.read_text().splitlines()[1:]:
        name, step, *values = line.split(",")
        rows.setdefault(name, []).append([float(step)] + [float(v) if v else np.nan
                                                          for v in values])
    return {name: (np.asarray(rows[name])[:, 0], np.asarray(rows[name])[:, 1:].T)
            for name in RUNS if name in rows}  # in RUNS order; rows of retired runs are skipped


def smooth(returns: np.ndarray) -> np.ndarray:
    """Trailing mean over 2% of the iterations, per seed; iterations with no episode skipped."""
    window = max(1, returns.shape[-1] // 50)
    out = np.full_like(returns, np.nan)
    for i in range(returns.shape[-1]):
        chunk = returns[..., max(0, i - window + 1): i + 1]
        seen = ~np.isnan(chunk)
        out[..., i] = np.where(seen.any(-1), np.nansum(chunk, -1) / np.maximum(seen.sum(-1), 1),
                               np.nan)
    return out


def plot(axis, env: str, curves: dict) -> None:
    for name, (steps, returns) in curves.items():
        returns = returns[~np.isnan(returns).all(1)]  # columns of seeds this run did not have
        smoothed = smooth(returns)
        with warnings.catch_warnings():  # iterations where no seed finished an episode: NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, std = np.nanmean(smoothed, 0), np.nanstd(smoothed, 0)
        line, = axis.plot(steps, mean, label=f"{name.replace(f' {env}', '')} "
                                             f"({returns.shape[0]} seeds)")
        axis.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2)
        if name in TARGETS:
            axis.axhline(TARGETS[name], color=line.get_color(), linestyle=":", linewidth=1)
    axis.set(title=env, xlabel="env steps per seed", ylabel="episodic return (band: ± 1 std)")
    axis.legend(fontsize=7)


def write_plots(out: Path) -> None:
    """<env>.png for every env with a CSV, and learning.png with all of them (the README's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = list(dict.fromkeys(env_of(n) for n in RUNS))
    curves = {env: load_curves(out / f"{env}.csv") for env in order
              if (out / f"{env}.csv").exists()}
    if not curves:
        return
    for env, runs in curves.items():
        figure, axis = plt.subplots(figsize=(6, 4))
        plot(axis, env, runs)
        figure.tight_layout()
        figure.savefig(out / f"{env}.png", dpi=100)
        plt.close(figure)
    columns, rows = 3, -(-len(curves) // 3)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for axis, (env, runs) in zip(axes.flat, curves.items()):
        plot(axis, env, runs)
    for axis in axes.flat[len(curves):]:
        axis.axis("off")
    figure.tight_layout()
    figure.savefig(out / "learning.png", dpi=80)
    plt.close(figure)


def markdown(report: dict) -> str:
    lines = [
        "# Learning results",
        "",
        f"{SEEDS} seeds per run, trained at once in one program (`--num-seeds {SEEDS}`), on "
        f"{describe(report['machine'], report['versions'])}.",
        "Final return: the mean episodic return over the last 5% of iterations, per seed; the "
        "table gives its mean ± std over seeds. Wall time: compile + train of the whole program.",
        "",
        "| run | env steps per seed | final return | target | met | published figures "
        "| wall time (s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in (n for n in RUNS if n in report["runs"]):
        row = report["runs"][name]
        masked = " masked" if name.endswith(" masked") else ""
        references = "; ".join(REFERENCES.get(env_of(name) + masked, [])) or "none"
        if "error" in row:
            error = row["error"].replace("|", "/")
            lines.append(f"| {name} | | {error} | | | {references} | |")
            continue
        target = TARGETS.get(name)
        met = "" if target is None else ("yes" if row["mean"] >= target else "**no**")
        seeds = f"{len(row['seeds'])} seeds, quick smoke run" if row.get("quick") else ""
        lines.append(
            f"| {name}{f' ({seeds})' if seeds else ''} | {row['steps_per_seed']:,} "
            f"| {row['mean']:.1f} ± {row['std']:.1f} "
            f"| {'' if target is None else f'≥ {target}'} | {met} | {references} "
            f"| {row['compile_s']:.0f} + {row['train_s']:.0f} |")
    lines += ["", "Sources: " + "; ".join(f"{k}: {v}" for k, v in SOURCES.items()) + ". "
              "Ours and CleanRL's are returns of the stochastic policy during training; gymnax's "
              "and SB3's evaluate a trained model."]
    lines += ["", "Each row, reproduced:", "", "```"]
    lines += [report["runs"][n].get("command", command_of(n)) for n in RUNS
              if n in report["runs"]]
    return "\n".join(lines + ["```", ""])


def time_left(report: dict, names: list, quick: bool) -> str:
    """The time the runs still to do took when last measured (results/learning.json)."""
    measured = [report["runs"].get(n, {}) for n in names]
    seconds = sum(r["compile_s"] + r["train_s"] for r in measured if "train_s" in r)
    unknown = sum("train_s" not in r for r in measured)
    if quick:
        return "quick smoke run"
    return (f"about {seconds / 60:.0f} min left by the last measured times"
            + (f", plus {unknown} runs with no measured time" if unknown else ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="RUN_OR_ENV",
                        help="run names or env ids; default: every run")
    parser.add_argument("--quick", action="store_true", help="two iterations, two seeds each")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--timeout", type=int, default=3 * 3600,
                        help="seconds per run at most; a run that uses no CPU for 60 s is "
                             "stopped and reported as hung sooner")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.timeout <= 0:
        parser.error(f"--timeout must be a positive number of seconds, got {options.timeout}")
    if options.quick and not options.worker and options.out.resolve() == HERE / "results":
        parser.error("--quick needs --out DIR: its tiny runs would replace the measured results")
    if options.worker:
        worker(options.worker, options.quick, options.worker_out)
        return

    names = list(RUNS)
    if options.only:
        unknown = [o for o in options.only if o not in RUNS and o not in map(env_of, RUNS)]
        if unknown:
            envs = sorted(set(map(env_of, RUNS)))
            parser.error(f"--only: unknown {unknown}; choose run names {list(RUNS)} "
                         f"or env ids {envs}")
        names = [n for n in RUNS if n in options.only or env_of(n) in options.only]

    options.out.mkdir(parents=True, exist_ok=True)
    json_path = options.out / "learning.json"
    report = json.loads(json_path.read_text()) if json_path.exists() else dict(runs={})
    report.update(machine=machine(), versions=versions(), seeds=SEEDS)
    start = time.perf_counter()
    for index, name in enumerate(names):
        print(f"[{index + 1}/{len(names)}] {name}: {command_of(name)}  "
              f"({time_left(report, names[index:], options.quick)})", flush=True)
        result = run(name, options.quick, options.timeout)
        # a failed run's old curve goes too: the table shows its error, the plot nothing
        curves = result.pop("curves", ((), np.empty((0, 0))))
        save_curves(options.out / f"{env_of(name)}.csv", name, *curves)
        report["runs"][name] = result
        print("  " + (result["error"] if "error" in result else
                      f"final {result['mean']:.1f} ± {result['std']:.1f} {result['final']}, "
                      f"{result['compile_s']:.0f} s compile + {result['train_s']:.0f} s train"),
              flush=True)
        json_path.write_text(json.dumps(report, indent=1))  # after each run: a crash loses none
    print(f"all {len(names)} runs in {(time.perf_counter() - start) / 60:.0f} min", flush=True)

    if importlib.util.find_spec("matplotlib"):
        write_plots(options.out)
    else:
        print("no plots: matplotlib is not installed (pip install -r benchmarks/requirements.txt)")
    (options.out / "learning.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
