"""Learning on the env suites of suites.py, 8 seeds a row, each row in its own file in
results/suites/, then results/suites.md (table), suites.csv (every run's curve) and suites.png:

- memory where it is needed: ppo_nnx_vae_lstm.py against ppo_nnx.py, with the same flags, on
  xminigrid's MiniGrid-MemoryS8, where the object seen at the start picks the right one at the
  end of the corridor; a policy without memory can only guess, and wins about half the time;
- continuous control: ppo_nnx.py on MuJoCo Playground's CartpoleBalance (return at most 1000).

    python benchmarks/env_suites.py                     # every row: about 75 min on a 2-core CPU
    python benchmarks/env_suites.py --only MemoryS8     # the rows whose name has any of these
    python benchmarks/env_suites.py --report            # the summary again, from the files
    python benchmarks/env_suites.py --step-speed popgym_arcade/CartPoleEasy-partial-16
                                                        # random env steps/s of suites' envs

Run it with the Python that has requirements-envs.txt and benchmarks/requirements.txt.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from report import plot, write_csv

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SEEDS = 8
SUITES = (
    "xminigrid",
    "playground",
    "mujoco",
)  # the versions each result is reported with
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
BUDGET = 5_000_000  # Playground's own PPO settings train it for 60M
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
]


def run_ours(name: str, script: str, flags: list, out: Path) -> None:
    command = [sys.executable, "benchmarks/record.py", "--name", name, str(out), script]
    command += [*flags, "--num-seeds", str(SEEDS), *EVAL]
    subprocess.run(command, cwd=ROOT, check=True, timeout=3 * 3600)


def report() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for name, *_ in ROWS:
        path = RESULTS / "suites" / f"{name.replace(' ', '-')}.json"
        if path.exists():
            runs[name] = json.loads(path.read_text())
    if not runs:
        sys.exit(f"env_suites.py: no result files in {RESULTS / 'suites'}")
    lines = [
        "# Env suites",
        "",
        "`python benchmarks/env_suites.py`; each row's command is in its file in `suites/`.",
        "Returns: mean ± std over the seeds, of the last iteration's episodes and of 100",
        "evaluation episodes per seed (sampled actions). Wall time: compile and training of",
        "all 8 seeds in one program.",
        "",
        "| run | env steps per seed | last iteration | evaluated | per seed (evaluated) | wall time |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    envs = {}
    for name, run in runs.items():
        envs.setdefault(run["args"]["env_id"], {})[name] = run
        seeds = len(run["seeds"])
        each = " ".join(f"{value:.2f}" for value in run["eval_return"])
        wall = run["compile_s"] + statistics.median(run["train_s"])
        lines.append(
            f"| {name} | {run['env_steps'] // seeds:,} | {run['mean']:.2f} ± {run['std']:.2f} "
            f"| {run['eval_mean']:.2f} ± {run['eval_std']:.2f} | {each} | {wall / 60:.0f} min |"
        )
    first = next(iter(runs.values()))
    versions = [f"{k} {v}" for k, v in first["versions"].items() if v]
    pins = (ROOT / "requirements-envs.txt").read_text().splitlines()
    versions += [pin.replace("==", " ") for pin in pins if pin.split("==")[0] in SUITES]
    versions = ", ".join(versions)
    lines += [
        "",
        f"{first['machine']['cpu']}, {first['machine']['cores']} cores; {versions}.",
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


def step_speed(names: list, num_envs: int = 64, num_steps: int = 200) -> None:
    """Env steps/s of random actions, vmapped and scanned under jit. The observations are summed
    into the result: a program that drops them lets XLA skip rendering them."""
    import time

    import jax

    sys.path.insert(0, str(ROOT))
    import suites

    for name in names:
        env = getattr(suites, name)()
        params = env.default_params
        step = jax.vmap(env.step, in_axes=(0, 0, 0, None))

        def steps(key):  # compiled below, in this same iteration
            keys = jax.random.split(key, num_envs)
            _, state = jax.vmap(env.reset, in_axes=(0, None))(keys, params)

            def body(state, key):
                act_keys, step_keys = jax.random.split(key, (2, num_envs))
                action = jax.vmap(env.action_space(params).sample)(act_keys)
                obs, state, reward, *_ = step(step_keys, state, action, params)
                return state, reward.sum() + obs.sum()

            return jax.lax.scan(body, state, jax.random.split(key, num_steps))[1].sum()

        compiled = jax.jit(steps).lower(jax.random.key(0)).compile()
        begin = time.time()
        compiled(jax.random.key(1)).block_until_ready()
        rate = num_envs * num_steps / (time.time() - begin)
        print(f"{name}: {rate:,.0f} env steps/s ({num_envs} envs, random actions)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="+", metavar="TEXT", help="rows whose name has one"
    )
    parser.add_argument("--report", action="store_true", help="the summary only")
    parser.add_argument(
        "--step-speed",
        nargs="+",
        metavar="SUITE/NAME",
        help="env steps/s of these envs",
    )
    options = parser.parse_args()
    if options.step_speed:
        return step_speed(options.step_speed)
    rows = [r for r in ROWS if not options.only or any(t in r[0] for t in options.only)]
    if not rows:
        sys.exit(f"env_suites.py: no row's name has {' or '.join(options.only)}")
    for name, script, flags in [] if options.report else rows:
        out = RESULTS / "suites" / f"{name.replace(' ', '-')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"{name} ...", flush=True)
        run_ours(name, script, flags, out)
    report()


if __name__ == "__main__":
    main()
