"""benchmarks/record.py and report.py on tiny runs: a file per run, tables and plots from them.

The figures themselves are measured outside the tests (benchmarks/learning.py and speed.sh).
"""

import importlib.metadata
import importlib.util
import json
import math
import shutil
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

import suites

ROOT = Path(__file__).resolve().parents[1]
RECORD, REPORT = ROOT / "benchmarks" / "record.py", ROOT / "benchmarks" / "report.py"
LEARNING = ROOT / "benchmarks" / "learning.py"
# 2 seeds x 2 iterations of 4 envs x 128 steps: one compile of a few seconds
TINY = [
    "--total-timesteps",
    "1024",
    "--num-envs",
    "4",
    "--num-steps",
    "128",
    "--num-seeds",
    "2",
]
NAME = "ppo_nnx CartPole-v1"


def python(script: Path, *argv):
    return subprocess.run(
        [sys.executable, str(script), *map(str, argv)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A results folder laid out as learning.py and speed.sh make it, and report.py run on it."""
    folder = tmp_path_factory.mktemp("results")
    for argv in (
        ["--name", NAME, folder / "learning" / "run.json", "ppo_nnx", *TINY],
        [
            "--repeats",
            "2",
            "--name",
            "floor",
            folder / "speed" / "floor" / "round1.json",
            "floor",
            "--num-envs",
            "4",
            "--total-timesteps",
            "1024",
        ],
    ):
        done = python(RECORD, *argv)
        assert done.returncode == 0, done.stderr
    (folder / "side_by_side").mkdir()  # the same run, as a side-by-side one
    shutil.copy(folder / "learning" / "run.json", folder / "side_by_side")
    done = python(REPORT, "--results", folder)
    assert done.returncode == 0, done.stderr
    return folder


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def csv_lines(run: dict) -> list:
    """The lines report.py should write for a run: per iteration, each seed's return, 2 decimals."""
    return [
        ",".join(
            [run["name"], str(step)] + ["" if v is None else f"{v:.2f}" for v in values]
        )
        for step, values in zip(run["global_step"], zip(*run["episodic_return"]))
    ]


def test_learning_record(results):
    run = load(results / "learning" / "run.json")
    assert (run["name"], run["script"], run["flags"]) == (NAME, "ppo_nnx", TINY)
    assert run["command"] == "python ppo_nnx.py " + " ".join(TINY)
    assert run["args"]["env_id"] == "CartPole-v1" and run["args"]["num_seeds"] == 2
    assert run["seeds"] == [1, 2]  # --seed 1 (the default) .. seed + num_seeds - 1
    assert run["global_step"] == [512, 1024] and run["env_steps"] == 2 * 1024
    returns = run["episodic_return"]
    assert len(returns) == 2 and all(len(seed) == 2 for seed in returns)
    # random CartPole episodes last about 20 steps: every seed ends some in every iteration
    assert all(math.isfinite(v) and v >= 1 for seed in returns for v in seed), returns
    # final: the mean over the last 5% of iterations, here the last one; not the first one
    assert run["final"] == pytest.approx([seed[-1] for seed in returns], rel=1e-6)
    assert run["final"] != pytest.approx([seed[0] for seed in returns], rel=1e-6)
    assert run["mean"] == pytest.approx(statistics.mean(run["final"]))
    assert run["std"] == pytest.approx(
        statistics.pstdev(run["final"])
    )  # numpy's: over seeds
    assert run["std"] != pytest.approx(statistics.stdev(run["final"]))
    assert run["compile_s"] > 0 and len(run["train_s"]) == 1 and run["train_s"][0] > 0
    assert run["versions"]["jax"] == importlib.metadata.version("jax")
    assert run["machine"]["cores"] >= 1 and run["machine"]["devices"]
    datetime.strptime(run["date"], "%Y-%m-%d %H:%M UTC")


def test_speed_record(results):
    floor = load(results / "speed" / "floor" / "round1.json")
    assert (floor["name"], floor["script"]) == ("floor", "floor")
    assert floor["args"] == {"num_envs": 4, "total_timesteps": 1024}
    assert floor["env_steps"] == 1024  # 256 steps of 4 envs
    assert floor["compile_s"] > 0 and len(floor["train_s"]) == 2
    assert all(t > 0 for t in floor["train_s"])
    assert "seeds" not in floor and "episodic_return" not in floor


def test_report_writes_curves_and_tables(results):
    run = load(results / "learning" / "run.json")
    lines = (results / "CartPole-v1.csv").read_text().splitlines()
    assert lines == ["run,global_step,seed_0,seed_1"] + csv_lines(run)
    assert not (results / "Pendulum-v1.csv").exists()  # no run of that env
    assert (results / "learning.md").stat().st_size > 0 and (
        results / "speed.md"
    ).stat().st_size
    row = f"| CartPole-v1 | ppo_nnx | 1,024 | {run['mean']:.1f} ± {run['std']:.1f} |"
    assert row in (results / "side_by_side.md").read_text()
    if importlib.util.find_spec(
        "matplotlib"
    ):  # a benchmarks requirement, not a main one
        assert (results / "CartPole-v1.png").stat().st_size > 0
        assert (results / "learning.png").stat().st_size > 0
        assert (results / "side_by_side.png").stat().st_size > 0


def test_report_rewrites_from_the_files_alone(results, tmp_path):
    """Rename a run and change its returns: its old lines go, nothing is merged in."""
    folder = tmp_path / "results"
    shutil.copytree(results, folder)
    before = (folder / "CartPole-v1.csv").read_text().splitlines()
    run = load(folder / "learning" / "run.json")
    run["name"] = "ppo_nnx CartPole-v1 changed"
    run["episodic_return"] = [[v + 1 for v in seed] for seed in run["episodic_return"]]
    (folder / "learning" / "run.json").write_text(json.dumps(run))
    done = python(REPORT, "--results", folder)
    assert done.returncode == 0, done.stderr
    after = (folder / "CartPole-v1.csv").read_text().splitlines()
    assert after == ["run,global_step,seed_0,seed_1"] + csv_lines(run)
    assert after != before and not set(after[1:]) & set(before[1:])


@pytest.mark.parametrize(
    "argv, message, allowed",
    [
        (["nope"], "unknown SCRIPT 'nope'", "ppo_nnx_vae_lstm"),
        (
            ["floor", "--num-steps", "8"],
            "unknown flag --num-steps for floor",
            "--num-envs",
        ),
        (
            ["ppo_nnx", "--no-such-flag", "1"],
            "unknown flag --no-such-flag for ppo_nnx",
            "--env-id",
        ),
        (
            ["rejax", "--mask-velocity"],
            "--mask-velocity does not apply to rejax",
            "--activation",
        ),
    ],
)
def test_record_rejects_bad_input(tmp_path, argv, message, allowed):
    done = python(RECORD, tmp_path / "out.json", *argv)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert message in done.stderr and allowed in done.stderr, done.stderr
    assert not list(tmp_path.iterdir())  # wrote nothing


def test_rejax_adapter_counts_the_training_return():
    """The adapter's episodes ended and returns summed, against the plain gymnax env stepped with
    the same keys; episodes end both ways, by termination and at a time limit (rejax itself is a
    benchmarks requirement: the adapter needs gymnax only)."""
    import gymnax
    import jax

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from record import Gymnax1To5Tuple

    env, params = gymnax.make("CartPole-v1")
    params = params.replace(
        max_steps_in_episode=12
    )  # a time limit that balancing reaches
    adapter = Gymnax1To5Tuple(env)
    step, plain_step = jax.jit(adapter.step), jax.jit(env.step)
    _, state = adapter.reset(jax.random.key(0), params)
    _, plain = env.reset(jax.random.key(0), params)
    so_far, returns, kinds = 0.0, [], set()
    for t in range(
        300
    ):  # pushing left 6 steps in 7: some episodes fall, some run out of time
        key, action = jax.random.key(t + 1), int(t % 7 == 6)
        _, state, *_ = step(key, state, action, params)
        _, plain, reward, terminated, truncated, _ = plain_step(
            key, plain, action, params
        )
        so_far += float(reward)
        if terminated or truncated:
            returns, so_far = returns + [so_far], 0.0
            kinds.add("terminated" if terminated else "truncated")
    assert kinds == {"terminated", "truncated"}, kinds
    assert int(state[3]) == len(returns) > 10
    assert float(state[2]) == pytest.approx(sum(returns)) and float(state[1]) == so_far
    # negative control: leaving out the reward of each episode's last step
    assert float(state[2]) != pytest.approx(sum(returns) - len(returns))


def test_rejax_training_return_per_iteration():
    """From the running totals after each iteration to each iteration's mean return."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from record import per_iteration

    summed = [[10.0, 10.0, 40.0], [0.0, 6.0, 6.0]]  # 2 seeds x 3 iterations, after each
    ended = [[1, 1, 3], [0, 2, 2]]
    np.testing.assert_array_equal(
        per_iteration(summed, ended), [[10.0, np.nan, 15.0], [np.nan, 3.0, np.nan]]
    )
    # negative control: the totals themselves divided are not the per-iteration means
    assert not np.allclose(
        np.divide(summed, np.maximum(ended, 1)), [[10, 0, 15], [0, 3, 0]]
    )


def test_learning_runs_parse_and_select():
    """Every run of learning.py has flags its script takes; --only picks by name; --list runs
    nothing."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import learning
    import record

    for name, folder, script, flags in learning.RUNS:
        _, args = (
            record.parse_rejax(flags)
            if script == "rejax"
            else record.parse_ours(script, flags)
        )
        assert name.split()[1] == args.env_id and folder in (
            "learning",
            "side_by_side",
        ), name
    done = python(LEARNING, "--only", "Acrobot", "--list")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all("--env-id Acrobot-v1" in line for line in lines), (
        lines
    )
    done = python(LEARNING, "--only", "Nope", "--list")
    assert (
        done.returncode == 1 and "no run's folder/name contains Nope" in done.stderr
    ), done.stderr
    done = python(LEARNING, "--only", "side_by_side/", "--list")
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == [
        f"side_by_side/{script} {env}"
        for env in ("CartPole-v1", "Breakout-MinAtar", "Asterix-MinAtar")
        for script in ("ppo_nnx", "rejax")
    ], done.stdout


def test_report_header_joins_runs_that_lack_a_package():
    """A run of ours, made where rejax was not installed, shares the header of rejax's runs;
    another jax version gets its own."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report

    machine = dict(cpu="EPYC", cores=2, devices=["cpu:0"], python="3.12.1")
    ours = dict(machine=machine, versions=dict(jax="0.11.2", rejax=None))
    theirs = dict(machine=machine, versions=dict(jax="0.11.2", rejax="0.1.3"))
    older = dict(machine=machine, versions=dict(jax="0.10.2", rejax=None))
    one = report.stacks({"ours": [ours], "rejax": [theirs]})
    assert (
        one == "EPYC (2 cores), devices cpu:0, Python 3.12.1; jax 0.11.2, rejax 0.1.3"
    )
    two = report.stacks({"ours": [ours], "older": [older]})
    assert two.count("(ours)") == two.count("(older)") == 1 and "jax 0.10.2" in two, two


def test_env_suite_rows_parse_and_select():
    """Every row of env_suites.py has flags its script takes, where the suite is installed;
    --only with no match runs nothing."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import env_suites
    import record

    ours = [
        (name, s, flags) for name, s, flags in env_suites.ROWS if s != "playground_ppo"
    ]
    assert {s for _, s, _ in ours} == {"ppo_nnx", "ppo_nnx_vae_lstm"}
    for name, script, flags in ours:
        env_id = flags[flags.index("--env-id") + 1]
        module = suites.SUITES[env_id.split(":")[1].split("/")[0]][1]
        if importlib.util.find_spec(module) is not None:
            _, args = record.parse_ours(script, flags)
            assert args.env_id == env_id and name.split()[0] == script, name
    done = python(ROOT / "benchmarks" / "env_suites.py", "--only", "Nope")
    assert done.returncode == 1 and "no row's name has Nope" in done.stderr, done.stderr
