"""Reproducible, never hung, and loud when a run fails: seeds, the stress check, NaN, W&B.

Every equality check here comes with a control that must fail it.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ppo_nnx
from conftest import TINY_FLAGS, run_cli, same_run, tiny_args, train

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import stress  # noqa: E402


@pytest.fixture(scope="module", params=["ppo_nnx", "ppo_nnx_vae_lstm"])
def seed_runs(request):
    """30 iterations of seeds 0..2 vmapped, and of one seed alone (not vmapped, as --num-seeds 1
    runs), the alone program compiled twice; "seed 2" is the vmapped run's (the controls')."""
    script = __import__(request.param)
    args = tiny_args(script, total_timesteps=4 * 32 * 30, latent_size=4)
    vmapped = train(script, dataclasses.replace(args, seed=0, num_seeds=3))
    runs = {
        "vmapped": vmapped,
        "seed 1": train(script, dataclasses.replace(args, seed=1)),
        "seed 1 again": train(script, dataclasses.replace(args, seed=1)),
    }
    runs = {
        name: {k: v[-1] if name != "vmapped" else v for k, v in run.items()}
        for name, run in runs.items()
    }
    return {**runs, "seed 2": {k: v[2] for k, v in vmapped.items()}}


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k], equal_nan=True) for k in a
    )


def test_same_seed_twice_is_bitwise_identical(seed_runs):
    assert bitwise_equal(seed_runs["seed 1"], seed_runs["seed 1 again"])
    assert not bitwise_equal(seed_runs["seed 1"], seed_runs["seed 2"])  # control


def test_vmapped_seed_matches_the_seed_alone(seed_runs):
    """Seed i of an N-seed vmapped run is `--seed i` alone, for all 30 iterations. Not bitwise:
    batched matmuls sum in another order, so losses differ from the second iteration at about
    1e-7 relative (a 500-iteration run stayed within 4e-7 and kept every return equal)."""
    vmapped_seed_1 = {k: v[1] for k, v in seed_runs["vmapped"].items()}
    assert same_run(vmapped_seed_1, seed_runs["seed 1"])
    assert not same_run(
        seed_runs["seed 2"], seed_runs["seed 1"]
    )  # control: another seed
    assert (
        np.isfinite(vmapped_seed_1["charts/episodic_return"]).sum() > 10
    )  # episodes ended


@pytest.mark.parametrize("rows", [32_769, 65_536])
def test_no_vmapped_matvec_reduction_miscompile(rows):
    """https://github.com/jax-ml/jax/issues/39103, the reported pattern: jaxlib 0.10.2 on CPU
    returns a wrong sum for a vmapped mat-vec followed by a reduction from 32,769 float32 rows on.
    Control: on jaxlib 0.10.2 this test fails at 32,769 rows (the last row 1071645696, not
    1073741824). 65,536 rows is the size of 8 seeds x 64 envs x 128 steps."""
    i = jnp.arange(rows, dtype=jnp.float32)
    x = jnp.stack([i, jnp.zeros_like(i), jnp.zeros_like(i)], axis=1)
    matrix = jnp.eye(3, dtype=jnp.float32)
    got = jax.jit(jax.vmap(lambda row: jnp.sum((matrix @ row) ** 2)))(x)
    np.testing.assert_allclose(
        np.asarray(got), np.arange(rows, dtype=np.float64) ** 2, rtol=1e-6
    )


# ---------------------------------------------------------------------------------------------
# The stress check
# ---------------------------------------------------------------------------------------------
def test_watchdog_calls_an_idle_process_hung():
    """Control for the stress check: a process that sleeps uses no CPU, like a deadlock."""
    result = stress.watch(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        idle_timeout=3,
        limit=300,
    )
    assert result["outcome"] == "hung" and result["exit_code"] == -9, (
        result
    )  # killed by it


def test_stress_check_short_run(tmp_path):
    """A few runs of `--num-seeds 5` (vmapped seeds, trained in chunks by `main`), no XLA_FLAGS:
    none may hang."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "stress.py"),
            "--entry",
            "cli",
            "--runs",
            "3",
            "--total-timesteps",
            "20480",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "stress.json").read_text())
    assert report["runs"] == 3 and report["counts"] == {"ok": 3}, report["counts"]
    assert [r["outcome"] for r in report["results"]] == ["ok"] * 3


# ---------------------------------------------------------------------------------------------
# A failing run says so
# ---------------------------------------------------------------------------------------------
def test_diverging_run_exits_1_naming_iteration_and_metric(script, capsys):
    """--learning-rate 1e30 blows the parameters up in the first update."""
    args = tiny_args(
        script, update_epochs=1, total_timesteps=1024, num_seeds=2, learning_rate=1e30
    )
    with pytest.raises(SystemExit) as exit_info:
        script.main(args)
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1 and len(errors) == 1, errors
    assert errors[0].startswith("error: seed 1: losses/"), errors
    assert "at iteration 1 of 8 (global_step 128)" in errors[0]


def test_first_nonfinite_names_the_first_bad_iteration():
    args = ppo_nnx.Args(
        num_envs=4, num_steps=32, total_timesteps=4 * 32 * 6, seed=10, num_seeds=2
    )
    metrics = {
        "losses/value_loss": np.ones((2, 6)),
        "losses/approx_kl": np.ones((2, 6)),
        "losses/explained_variance": np.full((2, 6), np.nan),  # NaN is normal here
        "charts/episodic_return": np.full((2, 6), np.nan),
    }
    params = {"w": np.ones((2, 3))}
    assert (
        ppo_nnx.first_nonfinite(args, metrics, params) is None
    )  # control: a healthy run
    metrics["losses/value_loss"][1, 4] = np.inf
    metrics["losses/approx_kl"][1, 5] = np.nan
    assert ppo_nnx.first_nonfinite(args, metrics, params).startswith(
        "seed 11: losses/value_loss is inf at iteration 5 of 6 (global_step 640)"
    )
    metrics["losses/value_loss"][1, 4] = metrics["losses/approx_kl"][1, 5] = 1.0
    params["w"][0, 2] = np.nan  # finite metrics, parameters gone bad at the end
    assert ppo_nnx.first_nonfinite(args, metrics, params).startswith(
        "seed 10: the weights are not finite at iteration 6 of 6"
    )


def test_track_without_credentials_logs_offline(tmp_path):
    """--track never waits on a login prompt: one notice, then an offline run. (With a key but no
    server, W&B gives up after its init timeout and the run goes offline the same way.)"""
    result = run_cli(
        ppo_nnx,
        *TINY_FLAGS,
        "--track",
        cwd=tmp_path,
        drop=["WANDB_"],
        env=dict(HOME=str(tmp_path), WANDB_DIR=str(tmp_path)),
    )  # no ~/.netrc key
    assert result.returncode == 0, result.stderr
    notices = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("notice: --track")
    ]
    assert len(notices) == 1 and "no W&B credentials" in notices[0], result.stderr
    assert "logging offline" in notices[0]
    assert len(list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))) == 1
