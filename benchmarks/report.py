"""Tables and plots from every result file that record.py wrote.

    python benchmarks/report.py [--results DIR]       # DIR: benchmarks/results by default

Reads DIR/learning/*.json and DIR/side_by_side/*.json (one learning run each) and
DIR/speed/<config>/*.json (one round of a speed configuration each), and writes in DIR, each file
whole and from those files alone: <env>.csv and <env>.png per env, learning.png, learning.md,
side_by_side.md and .png, and speed.md.
"""

import argparse
import importlib.util
import json
import statistics
import sys
import warnings
from pathlib import Path

import numpy as np

from common import describe

HERE = Path(__file__).resolve().parent

# The learning runs in table order (learning.py's); "<script> <env id>[ masked]". Others go last.
RUNS = [
    "ppo_nnx CartPole-v1",
    "ppo_nnx Acrobot-v1",
    "ppo_nnx CartPole-v1 normalized",
    "ppo_nnx Acrobot-v1 normalized",
    "ppo_nnx Pendulum-v1",
    "ppo_nnx MountainCarContinuous-v0",
    "ppo_nnx Pendulum-v1 unnormalized",
    "ppo_nnx MountainCarContinuous-v0 unnormalized",
    "ppo_nnx Breakout-MinAtar",
    "ppo_nnx SpaceInvaders-MinAtar",
    "ppo_nnx Asterix-MinAtar",
    "ppo_nnx Asterix-MinAtar 2x256",
    "ppo_nnx Freeway-MinAtar",
    "ppo_nnx CartPole-v1 masked",
    "ppo_nnx Pendulum-v1 masked",
    "ppo_nnx_vae_lstm CartPole-v1",
    "ppo_nnx_vae_lstm CartPole-v1 masked",
    "ppo_nnx_vae_lstm Pendulum-v1 masked",
]

# The mean over seeds that a run's eval return (its final return if it has none) should reach.
TARGETS = {
    "ppo_nnx CartPole-v1": 490,
    "ppo_nnx Acrobot-v1": -85,
    "ppo_nnx Pendulum-v1": -170,
    "ppo_nnx MountainCarContinuous-v0": 90,
    "ppo_nnx Breakout-MinAtar": 40,
    "ppo_nnx SpaceInvaders-MinAtar": 150,
    "ppo_nnx Asterix-MinAtar": 15,
    "ppo_nnx Asterix-MinAtar 2x256": 15,
    "ppo_nnx Freeway-MinAtar": 58,
    "ppo_nnx_vae_lstm CartPole-v1 masked": 475,
}

# Published figures by env (masked: "<env id> masked"), each with its source and budget: the
# training returns of a stochastic policy (to read beside our final return), and evaluations of
# a trained policy (beside our eval return).
TRAINING, EVALUATION = "training", "evaluation"
REFERENCES = {
    "CartPole-v1": {
        TRAINING: ["CleanRL 490.04 ± 6.12 (500k)", "PureJaxRL about 500 (500k)"],
        EVALUATION: ["gymnax 500 (budget not stated)"],
    },
    "Acrobot-v1": {
        TRAINING: ["CleanRL -86.36 ± 1.32 (500k)"],
        EVALUATION: ["gymnax -80 (budget not stated)"],
    },
    "Pendulum-v1": {
        EVALUATION: ["gymnax -130 (budget not stated; blines' PPO config: 1M)"]
    },
    "MountainCarContinuous-v0": {
        EVALUATION: [
            "gymnax 92, an evolution-strategies result, not PPO (budget not stated)",
            "gymnax-blines PPO near 0 (1M)",
        ]
    },
    "Breakout-MinAtar": {
        TRAINING: [
            "PureJaxRL about 40 (its README's plot, by seconds: budget not stated)"
        ],
        EVALUATION: [
            "gymnax 28 (budget not stated; blines' PPO config: 10M)",
            "gymnax-blines 22.9 at lr 5e-4, 43.4 at lr 1e-3 (9.9M)",
        ],
    },
    "SpaceInvaders-MinAtar": {
        TRAINING: ["PureJaxRL about 170 (10M)"],
        EVALUATION: ["gymnax 131 (budget not stated; blines' PPO config: 10M)"],
    },
    "Asterix-MinAtar": {
        EVALUATION: ["gymnax 15 (budget not stated; blines' PPO config: 10M)"]
    },
    "Freeway-MinAtar": {
        EVALUATION: ["gymnax 58 (budget not stated; blines' PPO config: 10M)"]
    },
    "CartPole-v1 masked": {EVALUATION: ["SB3 RL Zoo 500 ± 0 (100k)"]},
}
SOURCES = {
    "CleanRL": "CleanRL's docs for ppo.py, the returns of its training episodes (budget: its "
    "default, 500k steps, which its benchmark script keeps)",
    "PureJaxRL": "PureJaxRL's README (a CartPole plot by steps, a Breakout-MinAtar one by "
    "seconds) and its examples/brax_minatar.ipynb (SpaceInvaders-MinAtar, 10M steps, "
    "our MinAtar settings), training returns (its LogWrapper's)",
    "gymnax": "the gymnax README's table of its checkpoints, made with gymnax-blines and "
    "evaluated there on 164 episodes of the stochastic policy; the README states no "
    "budget, the blines config for each env does",
    "gymnax-blines": "the PPO logs of gymnax-blines (evaluation returns, as gymnax's), "
    "MountainCarContinuous-v0 at its PPO config (32 envs x 16 steps, lr 5e-4), "
    "Breakout-MinAtar with its config's network and gamma (2x256 ReLU, 0.999)",
    "SB3 RL Zoo": "SB3 RecurrentPPO on CartPoleNoVel-v1 (velocities removed), RL Zoo's "
    "benchmark.md and model card huggingface.co/sb3/ppo_lstm-CartPoleNoVel-v1: 10 "
    "deterministic episodes, 100k steps (LSTM 64, 20 epochs)",
}

# The speed configurations (speed.sh) in table order, and the ratios read from them.
CONFIGS = [
    "ppo_nnx",
    "rejax",
    "ppo_nnx 64 envs",
    "rejax 64 envs",
    "ppo_nnx 8 seeds",
    "ppo_nnx 8 seeds, 2 CPU devices",
    "ppo_nnx 32 seeds",
    "ppo_nnx_vae_lstm defaults",
    "ppo_nnx_vae_lstm at ppo_nnx settings",
    "ppo_nnx at ppo_nnx_vae_lstm settings",
    "ppo_nnx at ppo_nnx_vae_lstm settings, no bottleneck",
    "random actions (floor)",
]
RATIOS = {  # label -> (numerator, denominator, column)
    "ppo_nnx / rejax, CleanRL CartPole settings": ("ppo_nnx", "rejax", "sps"),
    "ppo_nnx / rejax compile time": ("ppo_nnx", "rejax", "compile_s"),
    "ppo_nnx / rejax, 64 envs": ("ppo_nnx 64 envs", "rejax 64 envs", "sps"),
    "8 seeds / 1 seed (aggregate env steps/s)": ("ppo_nnx 8 seeds", "ppo_nnx", "sps"),
    "8 seeds on 2 CPU devices (one per core) / 1 seed": (
        "ppo_nnx 8 seeds, 2 CPU devices",
        "ppo_nnx",
        "sps",
    ),
    "32 seeds / 1 seed (aggregate env steps/s)": ("ppo_nnx 32 seeds", "ppo_nnx", "sps"),
    "ppo_nnx / ppo_nnx_vae_lstm, the same flags (the recurrent defaults)": (
        "ppo_nnx at ppo_nnx_vae_lstm settings",
        "ppo_nnx_vae_lstm defaults",
        "sps",
    ),
    "ppo_nnx without its bottleneck / ppo_nnx_vae_lstm defaults (with one)": (
        "ppo_nnx at ppo_nnx_vae_lstm settings, no bottleneck",
        "ppo_nnx_vae_lstm defaults",
        "sps",
    ),
    "ppo_nnx / ppo_nnx_vae_lstm, both at CleanRL's settings (4 envs x 128 steps)": (
        "ppo_nnx",
        "ppo_nnx_vae_lstm at ppo_nnx settings",
        "sps",
    ),
    "random-action floor / ppo_nnx": ("random actions (floor)", "ppo_nnx", "sps"),
}


def by_name(files, order: list) -> dict:
    """name -> [records], in `order` and then by name; each name's records in file order."""
    found = {}
    for path in sorted(files):
        record = json.loads(path.read_text())
        found.setdefault(record["name"], []).append(record)
    rank = {name: i for i, name in enumerate(order)}
    return {
        n: found[n] for n in sorted(found, key=lambda n: (rank.get(n, len(rank)), n))
    }


def stacks(records: dict) -> str:
    """Where the records were measured: one machine and versions, or each with its runs."""
    groups = []  # [machine, versions, names]
    for name, runs in records.items():
        for run in runs:
            found = {k: v for k, v in run["versions"].items() if v}
            for machine, versions, names in groups:
                # a run without a package (ours, without rejax) shares the stack of runs with it
                same = (
                    found.items() <= versions.items()
                    or versions.items() <= found.items()
                )
                if machine == run["machine"] and same:
                    versions.update(found)
                    names.append(name)
                    break
            else:
                groups.append([run["machine"], found, [name]])
    if len(groups) == 1:
        return describe(*groups[0][:2])
    return "; ".join(
        f"{describe(machine, versions)} ({', '.join(dict.fromkeys(names))})"
        for machine, versions, names in groups
    )


def spread(values) -> str:  # "3", or "1 to 3" when the files disagree
    low, high = min(values), max(values)
    return f"{low}" if low == high else f"{low} to {high}"


# ----------------------------------------------------------------------------------------------
# Learning: one record per run
# ----------------------------------------------------------------------------------------------
def env_of(run: dict) -> str:
    return run["args"]["env_id"]


def by_env(runs: dict) -> dict:
    """env id -> {name: run}, in the runs' order."""
    envs = {}
    for name, run in runs.items():
        envs.setdefault(env_of(run), {})[name] = run
    return envs


def curves(run: dict):
    """(global_step [I], returns [seed, I]), NaN where no episode ended."""
    returns = [
        [np.nan if v is None else v for v in seed] for seed in run["episodic_return"]
    ]
    return np.asarray(run["global_step"]), np.asarray(returns, dtype=float)


def write_csv(path: Path, runs: dict) -> None:
    """A line per (run, iteration): the episodic return of every seed (empty: no episode ended)."""
    seeds = max(len(run["seeds"]) for run in runs.values())
    lines = [",".join(["run", "global_step"] + [f"seed_{i}" for i in range(seeds)])]
    for name, run in runs.items():
        steps, returns = curves(run)
        for step, values in zip(steps, returns.T):
            cells = ["" if np.isnan(v) else f"{v:.2f}" for v in values]
            lines.append(
                ",".join([name, str(step)] + cells + [""] * (seeds - len(cells)))
            )
    path.write_text("\n".join(lines) + "\n")


def smooth(returns: np.ndarray) -> np.ndarray:
    """Trailing mean over 2% of the iterations, per seed; iterations with no episode skipped."""
    window = max(1, returns.shape[-1] // 50)
    out = np.full_like(returns, np.nan)
    for i in range(returns.shape[-1]):
        chunk = returns[..., max(0, i - window + 1) : i + 1]
        seen = ~np.isnan(chunk)
        out[..., i] = np.where(
            seen.any(-1), np.nansum(chunk, -1) / np.maximum(seen.sum(-1), 1), np.nan
        )
    return out


def plot(axis, env: str, runs: dict, targets: bool = True) -> None:
    for name, run in runs.items():
        steps, returns = curves(run)
        returns = returns[
            ~np.isnan(returns).all(1)
        ]  # a seed that never ended an episode
        smoothed = smooth(returns)
        with (
            warnings.catch_warnings()
        ):  # iterations where no seed finished an episode: NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, std = np.nanmean(smoothed, 0), np.nanstd(smoothed, 0)
        (line,) = axis.plot(
            steps,
            mean,
            label=f"{name.replace(f' {env}', '')} ({returns.shape[0]} seeds)",
        )
        axis.fill_between(
            steps, mean - std, mean + std, color=line.get_color(), alpha=0.2
        )
        if targets and name in TARGETS:
            axis.axhline(
                TARGETS[name], color=line.get_color(), linestyle=":", linewidth=1
            )
    axis.set(
        title=env, xlabel="env steps per seed", ylabel="episodic return (band: ± 1 std)"
    )
    axis.legend(fontsize=7)


def write_plots(folder: Path, envs: dict) -> None:
    """<env>.png per env, and learning.png with all of them (the README's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for env, runs in envs.items():
        figure, axis = plt.subplots(figsize=(6, 4))
        plot(axis, env, runs)
        figure.tight_layout()
        figure.savefig(folder / f"{env}.png", dpi=100)
        plt.close(figure)
    columns, rows = 3, -(-len(envs) // 3)
    figure, axes = plt.subplots(
        rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False
    )
    for axis, (env, runs) in zip(axes.flat, envs.items()):
        plot(axis, env, runs)
    for axis in axes.flat[len(envs) :]:
        axis.axis("off")
    figure.tight_layout()
    figure.savefig(folder / "learning.png", dpi=80)
    plt.close(figure)


def learning_markdown(runs: dict) -> str:
    seeds = [len(run["seeds"]) for run in runs.values()]
    lines = [
        "# Learning results",
        "",
        f"{spread(seeds)} seeds per run, trained at once in one program (`--num-seeds "
        f"{spread(seeds)}`), on "
        f"{stacks({n: [r] for n, r in runs.items()})}.",
        "Final return: the stochastic policy's mean episodic return during training, over the "
        "last 5% of iterations. Eval return: the trained policy's, deterministic (`--eval-episodes "
        "100 --eval-deterministic`), the mean of its 100 episodes. Both per seed; the table gives "
        "their mean ± std over seeds. A target is met by the eval return (the final return where "
        "a row has no eval). Wall time: compile + train of the whole program. Published figures: "
        "source and budget in env steps; training returns and evaluations apart.",
        "",
        "| run | env steps per seed | final return | eval return | target | met "
        "| published, training | published, evaluation | wall time (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in runs.items():
        masked = " masked" if run["args"].get("mask_velocity") else ""
        references = REFERENCES.get(env_of(run) + masked, {})
        target = TARGETS.get(name)
        judged = run.get("eval_mean", run["mean"])
        met = (
            ""
            if target is None
            else ("yes" if judged is not None and judged >= target else "**no**")
        )
        final = (
            "no episode ended"
            if run["mean"] is None
            else f"{run['mean']:.1f} ± {run['std']:.1f}"
        )
        evaluated = (
            f"{run['eval_mean']:.1f} ± {run['eval_std']:.1f}"
            if "eval_mean" in run
            else "not run"
        )
        label = (
            name if min(seeds) == max(seeds) else f"{name} ({len(run['seeds'])} seeds)"
        )
        lines.append(
            f"| {label} | {run['global_step'][-1]:,} | {final} | {evaluated} "
            f"| {'' if target is None else f'≥ {target}'} | {met} "
            f"| {'; '.join(references.get(TRAINING, [])) or 'none'} "
            f"| {'; '.join(references.get(EVALUATION, [])) or 'none'} "
            f"| {run['compile_s']:.0f} + {statistics.median(run['train_s']):.0f} |"
        )
    lines += [
        "",
        "Sources: " + "; ".join(f"{k}: {v}" for k, v in SOURCES.items()) + ".",
    ]
    lines += ["", "Each row, reproduced:", "", "```"] + [
        r["command"] for r in runs.values()
    ]
    return "\n".join(lines + ["```", ""])


def report_learning(folder: Path) -> list:
    runs = by_name((folder / "learning").glob("*.json"), RUNS)
    for name, found in runs.items():
        if len(found) > 1:
            print(
                f"warning: {len(found)} learning files named {name!r}: the last one counts"
            )
    runs = {name: found[-1] for name, found in runs.items()}
    if not runs:
        return []
    envs = by_env(runs)
    written = []
    for env, env_runs in envs.items():
        write_csv(folder / f"{env}.csv", env_runs)
        written.append(f"{env}.csv")
    if importlib.util.find_spec("matplotlib"):
        write_plots(folder, envs)
        written += [f"{env}.png" for env in envs] + ["learning.png"]
    else:
        print(
            "no plots: matplotlib is not installed (pip install -r benchmarks/requirements.txt)"
        )
    (folder / "learning.md").write_text(learning_markdown(runs))
    return written + ["learning.md"]


def report_side_by_side(folder: Path) -> list:
    """side_by_side.md and .png: ours and rejax's PPO on the same flags, a panel per env."""
    runs = {
        name: found[-1]
        for name, found in by_name((folder / "side_by_side").glob("*.json"), []).items()
    }
    if not runs:
        return []
    envs = by_env(runs)
    lines = [
        "# Side by side with rejax's PPO",
        "",
        f"On {stacks({n: [r] for n, r in runs.items()})}. Both given the same flags (so the same "
        "settings, 64x64 network, budget and seeds), 8 seeds in one program each. Final return: "
        "the stochastic policy's mean episodic return during training over the last 5% of "
        "iterations, per seed; mean ± std and median over seeds. rejax's is counted by the "
        "adapter in record.py, as our scripts count theirs.",
        "",
        "| env | run | env steps per seed | final return | median | per seed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for env, env_runs in envs.items():
        for name, run in env_runs.items():
            ended = [v for v in run["final"] if v is not None]  # None: no episode ended
            final = (
                "no episode ended"
                if run["mean"] is None
                else f"{run['mean']:.1f} ± {run['std']:.1f}"
            )
            median = f"{statistics.median(ended):.1f}" if ended else ""
            seeds = ", ".join("-" if v is None else f"{v:.1f}" for v in run["final"])
            lines.append(
                f"| {env} | {name.split()[0]} | {run['global_step'][-1]:,} | {final} "
                f"| {median} | {seeds} |"
            )
    lines += ["", "Each row, reproduced:", "", "```"] + [
        r["command"] for r in runs.values()
    ]
    (folder / "side_by_side.md").write_text("\n".join(lines + ["```", ""]))
    if not importlib.util.find_spec("matplotlib"):
        return ["side_by_side.md"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(envs), figsize=(6 * len(envs), 4), squeeze=False)
    for axis, (env, env_runs) in zip(axes.flat, envs.items()):
        plot(axis, env, env_runs, targets=False)
    figure.tight_layout()
    figure.savefig(folder / "side_by_side.png", dpi=90)
    plt.close(figure)
    return ["side_by_side.md", "side_by_side.png"]


# ----------------------------------------------------------------------------------------------
# Speed: one record per configuration and round; medians over all rounds and calls
# ----------------------------------------------------------------------------------------------
def aggregate(rounds: list) -> dict:
    calls = [t for r in rounds for t in r["train_s"]]
    steps = rounds[0]["env_steps"]
    return dict(
        env_steps=steps,
        compile_s=statistics.median(r["compile_s"] for r in rounds),
        run_s=statistics.median(calls),
        sps=statistics.median(steps / t for t in calls),
    )


def speed_markdown(configs: dict) -> str:
    table = {name: aggregate(rounds) for name, rounds in configs.items()}
    dates = sorted(r["date"] for rounds in configs.values() for r in rounds)
    calls = [len(r["train_s"]) for rounds in configs.values() for r in rounds]
    rounds = spread([len(rounds) for rounds in configs.values()])
    lines = [
        "# Speed of the compiled train functions",
        "",
        f"Measured {spread([dates[0], dates[-1]])} on {stacks(configs)}.",
        f"{rounds} round{'' if rounds == '1' else 's'} of alternating processes, "
        f"{spread(calls)} timed calls per process; medians over all calls. Compile time is the "
        "median over rounds.",
        "",
        "| configuration | flags | env steps per call | compile (s) | run (s) | env steps/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in table.items():
        flags = " ".join(configs[name][0]["flags"]) or "(defaults)"
        lines.append(
            f"| {name} | `{configs[name][0]['script']} {flags}` | {row['env_steps']:,} "
            f"| {row['compile_s']:.1f} | {row['run_s']:.2f} | {row['sps']:,.0f} |"
        )
    lines += ["", "| ratio | value |", "| --- | --- |"]
    for label, (a, b, column) in RATIOS.items():
        value = (
            table[a][column] / table[b][column] if a in table and b in table else None
        )
        lines.append(f"| {label} | {'n/a' if value is None else f'{value:.2f}'} |")
    return "\n".join(lines) + "\n"


def report_speed(folder: Path) -> list:
    configs = by_name((folder / "speed").glob("*/*.json"), CONFIGS)
    if not configs:
        return []
    (folder / "speed.md").write_text(speed_markdown(configs))
    return ["speed.md"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results",
        type=Path,
        default=HERE / "results",
        help="the folder with learning/, side_by_side/ and speed/ "
        "(default: %(default)s)",
    )
    folder = parser.parse_args().results
    written = (
        report_learning(folder) + report_side_by_side(folder) + report_speed(folder)
    )
    if not written:
        sys.exit(
            f"report.py: no result files in {folder}/learning, side_by_side or speed/*"
        )
    print(f"wrote in {folder}: {', '.join(written)}")


if __name__ == "__main__":
    main()
