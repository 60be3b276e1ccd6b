"""The benchmark scripts still run (tiny budgets); their figures are measured outside the tests."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_speed_benchmark_quick_run(tmp_path):
    names = ["ppo_nnx", "random actions (floor)"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "speed.py"), "--quick", "--rounds", "1",
         "--repeats", "1", "--out", str(tmp_path), "--only", *names],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "speed.json").read_text())
    assert list(report["table"]) == names
    for name in names:
        row = report["table"][name]
        assert "error" not in row, row
        assert row["env_steps"] >= 1024 and row["sps"] > 0 and row["compile_s"] > 0
    assert report["machine"]["cores"] >= 1 and report["versions"]["jax"]
    table = (tmp_path / "speed.md").read_text()
    assert table.startswith("# Speed") and "| ppo_nnx |" in table


def test_learning_benchmark_quick_run(tmp_path):
    runs = ["ppo_nnx CartPole-v1", "ppo_nnx_vae_lstm Pendulum-v1 masked"]
    command = [sys.executable, str(ROOT / "benchmarks" / "learning.py"), "--quick",
               "--out", str(tmp_path), "--only"]
    for only in (runs, runs[:1]):  # the second run must replace its CSV lines, not add to them
        result = subprocess.run(command + only, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        assert f"[1/{len(only)}] ppo_nnx CartPole-v1: python ppo_nnx.py" in result.stdout
        assert f"all {len(only)} runs in " in result.stdout
    report = json.loads((tmp_path / "learning.json").read_text())
    assert sorted(report["runs"]) == sorted(runs)
    for name in runs:
        row = report["runs"][name]
        assert "error" not in row, row
        assert len(row["final"]) == 2 and row["steps_per_seed"] > 0 and row["train_s"] > 0
    cartpole = (tmp_path / "CartPole-v1.csv").read_text().splitlines()
    assert cartpole[0] == "run,global_step,seed_0,seed_1"
    assert [line.split(",")[:2] for line in cartpole[1:]] == [
        ["ppo_nnx CartPole-v1", "512"], ["ppo_nnx CartPole-v1", "1024"]]
    pendulum = (tmp_path / "Pendulum-v1.csv").read_text().splitlines()
    assert len(pendulum) == 3 and pendulum[1].startswith("ppo_nnx_vae_lstm Pendulum-v1 masked,")
    table = (tmp_path / "learning.md").read_text()
    assert "| ppo_nnx CartPole-v1 (2 seeds, quick smoke run) | 1,024 |" in table
    command = next(line for line in table.splitlines() if line.startswith("python ppo_nnx_vae"))
    assert command.startswith("python ppo_nnx_vae_lstm.py --env-id Pendulum-v1 ")
    assert command.endswith(" --mask-velocity --num-minibatches 4 --num-seeds 8")
    if importlib.util.find_spec("matplotlib"):  # a benchmarks requirement, not a main one
        assert (tmp_path / "CartPole-v1.png").stat().st_size > 0
        assert (tmp_path / "learning.png").stat().st_size > 0


@pytest.mark.parametrize("flags, message", [
    (["--only", "CartPole"], "--only: unknown ['CartPole']; choose run names"),
    # with a valid --out or a bad --only as a backstop: if a guard broke, nothing runs or writes
    (["--timeout", "0", "--only", "NoSuchRun"],
     "--timeout must be a positive number of seconds, got 0"),
    (["--quick", "--only", "NoSuchRun"], "--quick needs --out DIR"),
])
def test_learning_benchmark_rejects_bad_flags(flags, message):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "learning.py"), *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
