"""Learning curves: every run behind results/learning.md and results/side_by_side.md, then the
report. Each run trains 8 seeds in one program (`--num-seeds 8`) and writes its own result file
(record.py); ours also evaluate each trained policy on 100 episodes, deterministic. report.py then
makes the tables and plots from all the files there, so a subset reruns just its rows.

    python benchmarks/learning.py                        # all of it: about 5 h on a 2-core CPU
    python benchmarks/learning.py --only CartPole        # the runs whose name has any of these
    python benchmarks/learning.py --only side_by_side/   # a run's name starts with its folder
    python benchmarks/learning.py --only Pendulum MinAtar --list   # which runs, not running them

Run it from any folder with the Python that has the requirements (and benchmarks/requirements.txt).
"""

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL = ["--eval-episodes", "100", "--eval-deterministic"]
# After RL Zoo's PPO settings for Pendulum (4 envs x 1024 steps, 10 epochs), gamma 0.95 (Zoo's
# 0.9 reached -173). Continuous actions: observations and rewards normalized by default.
PENDULUM = [
    "--env-id",
    "Pendulum-v1",
    "--total-timesteps",
    "1000000",
    "--num-envs",
    "4",
    "--num-steps",
    "1024",
    "--update-epochs",
    "10",
    "--learning-rate",
    "1e-3",
    "--gamma",
    "0.95",
    "--ent-coef",
    "0",
]
# PureJaxRL's MinAtar settings (its examples/brax_minatar.ipynb): a 64x64 ReLU MLP, lr 5e-3
# annealed, 64 envs x 128 steps, 8 minibatches; the rest are CleanRL's, as ours.
MINATAR_BATCH = ["--num-envs", "64", "--num-steps", "128", "--num-minibatches", "8"]
MINATAR = [*MINATAR_BATCH, "--learning-rate", "5e-3", "--activation", "relu"]
# Asterix-MinAtar's own: gymnax-blines' MinAtar network and discount (a 2x256 ReLU MLP, gamma
# 0.999) at a constant lr of 1.5e-3 (tuning.md), 64 envs x 128 steps, 8 minibatches.
ASTERIX = [
    *MINATAR_BATCH,
    "--learning-rate",
    "1.5e-3",
    "--no-anneal-lr",
    "--gamma",
    "0.999",
    "--activation",
    "relu",
    "--hidden-size",
    "256",
]
MILLION = ["--total-timesteps", "1000000"]

# (name, folder under results/, script, flags): tuned per env (budget, envs, epochs, learning
# rate, gamma, activation), never the algorithm per env. The name is the row's and the file's.
RUNS = [
    (
        "ppo_nnx CartPole-v1",
        "learning",
        "ppo_nnx",
        ["--env-id", "CartPole-v1"],
    ),  # CleanRL's
    ("ppo_nnx Acrobot-v1", "learning", "ppo_nnx", ["--env-id", "Acrobot-v1", *MILLION]),
    # The same two normalized: the measurement behind the discrete default (off).
    (
        "ppo_nnx CartPole-v1 normalized",
        "learning",
        "ppo_nnx",
        ["--env-id", "CartPole-v1", "--norm-obs", "True", "--norm-reward", "True"],
    ),
    (
        "ppo_nnx Acrobot-v1 normalized",
        "learning",
        "ppo_nnx",
        [
            "--env-id",
            "Acrobot-v1",
            *MILLION,
            "--norm-obs",
            "True",
            "--norm-reward",
            "True",
        ],
    ),
    ("ppo_nnx Pendulum-v1", "learning", "ppo_nnx", PENDULUM),
    (
        "ppo_nnx MountainCarContinuous-v0",
        "learning",
        "ppo_nnx",
        ["--env-id", "MountainCarContinuous-v0", *MILLION],
    ),
    # The same two without normalization: the measurement behind the continuous default.
    (
        "ppo_nnx Pendulum-v1 unnormalized",
        "learning",
        "ppo_nnx",
        [*PENDULUM, "--norm-obs", "False", "--norm-reward", "False"],
    ),
    (
        "ppo_nnx MountainCarContinuous-v0 unnormalized",
        "learning",
        "ppo_nnx",
        [
            "--env-id",
            "MountainCarContinuous-v0",
            *MILLION,
            "--norm-obs",
            "False",
            "--norm-reward",
            "False",
        ],
    ),
    *[
        (
            f"ppo_nnx {env}",
            "learning",
            "ppo_nnx",
            ["--env-id", env, "--total-timesteps", "10000000", *MINATAR],
        )
        for env in (
            "Breakout-MinAtar",
            "SpaceInvaders-MinAtar",
            "Asterix-MinAtar",
            "Freeway-MinAtar",
        )
    ],
    (
        "ppo_nnx Asterix-MinAtar 2x256",
        "learning",
        "ppo_nnx",
        ["--env-id", "Asterix-MinAtar", "--total-timesteps", "10000000", *ASTERIX],
    ),
    # Masked: velocities hidden, which a feed-forward policy cannot make up for.
    (
        "ppo_nnx CartPole-v1 masked",
        "learning",
        "ppo_nnx",
        ["--env-id", "CartPole-v1", "--mask-velocity", *MILLION],
    ),
    (
        "ppo_nnx Pendulum-v1 masked",
        "learning",
        "ppo_nnx",
        [*PENDULUM, "--mask-velocity"],
    ),
    (
        "ppo_nnx_vae_lstm CartPole-v1",
        "learning",
        "ppo_nnx_vae_lstm",
        ["--env-id", "CartPole-v1"],
    ),  # the recurrent defaults, 1M steps
    (
        "ppo_nnx_vae_lstm CartPole-v1 masked",
        "learning",
        "ppo_nnx_vae_lstm",
        ["--env-id", "CartPole-v1", "--mask-velocity", "--lstm-size", "64"],
    ),  # 32 reached 424
    (
        "ppo_nnx_vae_lstm Pendulum-v1 masked",
        "learning",
        "ppo_nnx_vae_lstm",
        [*PENDULUM, "--mask-velocity", "--num-minibatches", "4"],
    ),
    # Side by side with rejax's PPO: the same flags, so the same settings, network and budget.
    *[
        (f"{script} {env}", "side_by_side", script, flags)
        for env, flags in [
            ("CartPole-v1", ["--env-id", "CartPole-v1"]),
            *[
                (env, ["--env-id", env, "--total-timesteps", "2000000", *MINATAR])
                for env in ("Breakout-MinAtar", "Asterix-MinAtar")
            ],
        ]
        for script in ("ppo_nnx", "rejax")
    ],
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="TEXT",
        help="just the runs whose folder/name contains one of these",
    )
    parser.add_argument(
        "--list", action="store_true", help="list the runs, run nothing"
    )
    options = parser.parse_args()
    names = [f"{folder}/{name}" for name, folder, *_ in RUNS]
    runs = [
        run
        for run, name in zip(RUNS, names)
        if not options.only or any(text in name for text in options.only)
    ]
    if not runs:
        sys.exit(
            f"learning.py: no run's folder/name contains {' or '.join(options.only)}; the "
            f"runs: {', '.join(names)}"
        )
    start = time.perf_counter()
    for name, folder, script, flags in runs:
        out = f"benchmarks/results/{folder}/{name.replace(' ', '-')}.json"
        command = [
            sys.executable,
            "benchmarks/record.py",
            "--name",
            name,
            out,
            script,
            *flags,
            "--num-seeds",
            "8",
            *(EVAL if script != "rejax" else []),
        ]
        print(
            f"{folder}/{name}: "
            + (shlex.join(["python", *command[1:]]) if options.list else "..."),
            flush=True,
        )
        if not options.list:  # a hung run stops at the timeout
            subprocess.run(command, cwd=ROOT, check=True, timeout=3 * 3600)
    if not options.list:
        subprocess.run([sys.executable, "benchmarks/report.py"], cwd=ROOT, check=True)
        print(
            f"learning.py: {len(runs)} runs in {(time.perf_counter() - start) / 60:.0f} min"
        )


if __name__ == "__main__":
    main()
