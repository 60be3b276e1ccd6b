"""Learning on the env suites of suites.py, 8 seeds a row, written to results/suites/ (one file a
row) and summed up in results/suites.md, suites.csv and suites.png:

- memory where it is needed: ppo_nnx_vae_lstm.py against ppo_nnx.py on xminigrid's
  MiniGrid-MemoryS8, where the cue seen at the start picks the door at the end;
- continuous control beside the suite's own PPO: ppo_nnx.py against MuJoCo Playground's PPO
  (brax's trainer with the settings Playground publishes for the env) on CartpoleBalance, both at
  the budget given here, a twelfth of Playground's 60M steps.

    python benchmarks/env_suites.py                        # every row
    python benchmarks/env_suites.py --only MemoryS8        # the rows whose name has any of these
    python benchmarks/env_suites.py --report               # the summary from the files there

Run it with the Python that has requirements-envs.txt and benchmarks/requirements.txt.
"""

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from report import plot, write_csv

from common import machine, versions

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SEEDS = 8
EVAL = ["--eval-episodes", "100"]
MEMORY = [
    "--env-id",
    "suites:xminigrid/MiniGrid-MemoryS8",
    "--total-timesteps",
    "10000000",
    "--learning-rate",
    "1e-3",
    "--num-envs",
    "64",
    "--num-steps",
    "128",
    "--num-minibatches",
    "4",
    "--gamma",
    "0.99",
    "--gae-lambda",
    "0.95",
    "--ent-coef",
    "0.01",
    "--norm-obs",
    "True",
]
CARTPOLE = "CartpoleBalance"
BUDGET = 5_000_000
# (name, script, flags): the name is the row's and its file's
ROWS = [
    (
        "ppo_nnx_vae_lstm MiniGrid-MemoryS8",
        "ppo_nnx_vae_lstm",
        [*MEMORY, "--lstm-size", "64", "--latent-size", "0"],
    ),
    ("ppo_nnx MiniGrid-MemoryS8", "ppo_nnx", MEMORY),
    (  # Playground's learning rate and gamma; batches of 4096 steps, 10 epochs
        f"ppo_nnx {CARTPOLE}",
        "ppo_nnx",
        [
            "--env-id",
            f"suites:playground/{CARTPOLE}",
            "--total-timesteps",
            str(BUDGET),
            "--num-envs",
            "64",
            "--num-steps",
            "64",
            "--num-minibatches",
            "4",
            "--update-epochs",
            "10",
            "--learning-rate",
            "1e-3",
            "--gamma",
            "0.995",
            "--ent-coef",
            "0",
        ],
    ),
    (f"playground_ppo {CARTPOLE}", "playground_ppo", []),
]


def run_ours(name: str, script: str, flags: list, out: Path) -> None:
    command = [sys.executable, "benchmarks/record.py", "--name", name, str(out), script]
    command += [*flags, "--num-seeds", str(SEEDS), *EVAL]
    subprocess.run(command, cwd=ROOT, check=True, timeout=3 * 3600)


def run_playground_ppo(name: str, out: Path) -> None:
    """Brax's PPO trainer on the Playground env, with Playground's published settings for it
    (its dm_control_suite_params), the budget set to BUDGET: one seed after another."""
    from brax.training.agents.ppo import train as ppo
    from mujoco_playground import registry, wrapper
    from mujoco_playground.config import dm_control_suite_params

    settings = dm_control_suite_params.brax_ppo_config(CARTPOLE).to_dict()
    steps_per_update = settings["batch_size"] * settings["unroll_length"]
    steps_per_update *= settings["num_minibatches"]
    # brax rounds each eval interval up to whole updates: one update per interval
    settings.update(num_timesteps=BUDGET, num_evals=BUDGET // steps_per_update + 1)
    env = registry.load(CARTPOLE, config_overrides={"impl": "jax"})
    returns, seconds = [], []
    for seed in range(SEEDS):
        curve, start = [], time.perf_counter()

        def progress(step, metrics):
            curve.append((int(step), float(metrics["eval/episode_reward"])))

        ppo.train(
            environment=env,
            wrap_env_fn=wrapper.wrap_for_brax_training,
            eval_env=registry.load(CARTPOLE, config_overrides={"impl": "jax"}),
            progress_fn=progress,
            seed=seed,
            **settings,
        )
        seconds.append(time.perf_counter() - start)
        returns.append([value for _, value in curve])
        print(f"{name}: seed {seed}, eval return {curve[-1][1]:.1f}", flush=True)
    final = [seed[-1] for seed in returns]
    record = dict(
        name=name,
        command=f"python benchmarks/env_suites.py --only '{name}'",
        date=datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        machine=machine(),
        versions=versions(),
        script="playground_ppo",
        settings=settings,
        seeds=list(range(SEEDS)),
        global_step=[step for step, _ in curve],
        episodic_return=returns,
        env_steps=curve[-1][0],
        train_s=seconds,
        eval_mean=statistics.mean(final),
        eval_std=statistics.pstdev(final),
        args=dict(env_id=f"suites:playground/{CARTPOLE}"),
    )
    out.write_text(json.dumps(record) + "\n")


def wall_s(run: dict) -> float:
    """The row's seconds: compile and train for ours (8 seeds at once), every seed's for brax's."""
    if run["script"] == "playground_ppo":
        return sum(run["train_s"])
    return run["compile_s"] + statistics.median(run["train_s"])


def report() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for name, *_ in ROWS:
        path = RESULTS / "suites" / f"{name.replace(' ', '-')}.json"
        if path.exists():
            runs[name] = json.loads(path.read_text())
    lines = [
        "# Env suites",
        "",
        "`python benchmarks/env_suites.py` ("
        + __doc__.split("\n\n")[0].split(", ", 1)[1],
        "",
        "| run | env steps per seed | last iteration's return | evaluated return | wall time |",
        "| --- | --- | --- | --- | --- |",
    ]
    envs = {}
    for name, run in runs.items():
        envs.setdefault(run["args"]["env_id"], {})[name] = run
        last = (
            f"{run['mean']:.2f} ± {run['std']:.2f}"
            if "mean" in run
            else "(evaluates only)"
        )
        evaluated = f"{run['eval_mean']:.2f} ± {run['eval_std']:.2f}"
        lines.append(
            f"| {name} | {run['env_steps']:,} | {last} | {evaluated} | {wall_s(run) / 60:.1f} min |"
        )
    first = next(iter(runs.values()))
    lines += [
        "",
        f"Mean ± std over {SEEDS} seeds. Machine: {first['machine']['cpu']}, "
        f"{first['machine']['cores']} cores; versions: {first['versions']}.",
        "",
    ]
    (RESULTS / "suites.md").write_text("\n".join(lines))
    write_csv(RESULTS / "suites.csv", runs)
    figure, axes = plt.subplots(1, len(envs), figsize=(6 * len(envs), 4), squeeze=False)
    for axis, (env, env_runs) in zip(axes.flat, envs.items()):
        plot(axis, env, env_runs, targets=False)
    figure.tight_layout()
    figure.savefig(RESULTS / "suites.png", dpi=90)
    print(f"wrote {RESULTS / 'suites.md'}, suites.csv and suites.png")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="+", metavar="TEXT", help="rows whose name has one"
    )
    parser.add_argument("--report", action="store_true", help="the summary only")
    options = parser.parse_args()
    rows = [r for r in ROWS if not options.only or any(t in r[0] for t in options.only)]
    if not rows:
        sys.exit(f"env_suites.py: no row's name has {' or '.join(options.only)}")
    for name, script, flags in [] if options.report else rows:
        out = RESULTS / "suites" / f"{name.replace(' ', '-')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"{name} ...", flush=True)
        if script == "playground_ppo":
            run_playground_ppo(name, out)
        else:
            run_ours(name, script, flags, out)
    report()


if __name__ == "__main__":
    main()
