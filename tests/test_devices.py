"""Many devices and many hosts, on CPU: processes with 4 fake devices (XLA_FLAGS, set before jax
starts) against this 1-device process. Seeds spread over devices compute what they compute on one;
one agent's envs spread over devices (--shard-envs) train what one device trains, and still replay
exactly; 2 processes of 2 devices train what 1 process of 4 does."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import ppo_nnx
import ppo_nnx_vae_lstm
from conftest import replay_matched, tiny_args

HERE = Path(__file__).parent


def devices_env(count: int) -> dict:
    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}",
    }


def on_devices(script, count: int, tmp_path, *runs) -> list:
    """(params leaves, metrics) of each run `(args, bug)`, trained in a process with `count`
    devices."""
    out = tmp_path / f"{script.__name__}_{count}.npz"
    result = subprocess.run(
        [sys.executable, str(HERE / "on_devices.py"), script.__name__, str(out)]
        + [json.dumps(dict(args=vars(args), bug=bug)) for args, bug in runs],
        env=devices_env(count),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saved = np.load(out)
    return [
        (
            [
                saved[k]
                for k in sorted(
                    (k for k in saved if k.startswith(f"{i} param ")),
                    key=lambda k: int(k.split()[-1]),
                )
            ],
            {k.split()[-1]: saved[k] for k in saved if k.startswith(f"{i} metric ")},
        )
        for i in range(len(runs))
    ]


def here(script, args) -> tuple:
    """The same, trained in this process, on its one device."""
    state, metrics, *_ = script.run(args)
    params = state.params
    return (
        [np.asarray(x) for x in jax.tree.leaves(params)],
        {k: np.asarray(v) for k, v in metrics.items()},
    )


def same_params(a: list, b: list) -> bool:  # up to float reduction order
    return len(a) == len(b) and all(
        np.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b)
    )


def seeds_args(script):  # 8 runs: 2 --sweep configurations x 4 seeds
    sweep = ("learning-rate=1e-3,3e-3",)
    return tiny_args(script, num_seeds=4, sweep=sweep, latent_size=4)


def sharded_args(script, **overrides):
    """2 seeds of 8 envs, 2 per device, 8 iterations: past Pendulum's 200-step limit. One
    minibatch, one epoch: every replay comes before any gradient step, so the ratio is 1 where
    replay is exact, and the update does not hang on how each device shuffles its envs (a sum
    over all samples). Pendulum: normalization on, as by default."""
    return tiny_args(
        script,
        env_id="Pendulum-v1",
        num_envs=8,
        num_minibatches=1,
        update_epochs=1,
        latent_size=4,
        num_seeds=2,
        total_timesteps=8 * 32 * 8,
        **overrides,
    )


@pytest.fixture(
    scope="module", params=[ppo_nnx, ppo_nnx_vae_lstm], ids=lambda m: m.__name__
)
def runs(request, tmp_path_factory):
    """Each script's runs on 4 devices and on one. The checks are the same code for both scripts:
    their negative controls run with ppo_nnx.py only, to keep the suite near its 10 minutes."""
    script = request.param
    sharded = sharded_args(script, shard_envs=True)
    names = ["seeds", "sharded"] + (
        ["local moments", "module rng"] if script is ppo_nnx else []
    )
    four = on_devices(
        script,
        4,
        tmp_path_factory.mktemp("devices"),
        (seeds_args(script), None),
        *[(sharded, bug) for bug in (None, "local_moments", "module_rng")][
            : len(names) - 1
        ],
    )
    return script, dict(
        zip(names, four),
        one_seeds=here(script, seeds_args(script)),
        one_sharded=here(script, sharded_args(script)),
    )


def test_seeds_over_4_devices_equal_one_device(runs):
    """2 --sweep configurations x --num-seeds 4 on 4 devices (2 runs each): run i ends where it
    ends on one device."""
    _, got = runs
    params, metrics = got["seeds"]
    one_params, one_metrics = got["one_seeds"]
    assert params[0].shape[0] == 8 and same_params(params, one_params)
    np.testing.assert_array_equal(
        metrics["charts/episodic_return"], one_metrics["charts/episodic_return"]
    )
    assert not same_params(
        params, [np.roll(x, 1, axis=0) for x in one_params]
    )  # control: seeds
    assert (
        np.isfinite(metrics["charts/episodic_return"]).any(-1).all()
    )  # episodes ended


def test_sharded_envs_equal_one_device(runs):
    """--shard-envs: 8 envs over 4 devices train the agent that 8 envs train on one device, and
    log the same metrics (episode returns summed over devices); the control takes the advantage
    and normalization statistics over one device's envs only, and misses."""
    _, got = runs
    assert same_params(got["sharded"][0], got["one_sharded"][0])
    (_, metrics), (_, one_metrics) = got["sharded"], got["one_sharded"]
    assert metrics.keys() == one_metrics.keys()
    for k in metrics:  # looser: rounding grows in ratios such as the explained variance
        np.testing.assert_allclose(
            metrics[k], one_metrics[k], rtol=1e-4, atol=1e-5, equal_nan=True, err_msg=k
        )
    assert np.isfinite(metrics["charts/episodic_return"]).sum() >= 2  # episodes ended
    if "local moments" in got:
        assert not same_params(got["local moments"][0], got["one_sharded"][0])


def test_sharded_replay_is_exact(runs):
    """Each device replays its own envs (whole sequences in the recurrent script) exactly; a
    bottleneck drawing from its module-level nnx.Rngs does not, sharded too."""
    _, got = runs
    assert replay_matched(got["sharded"][1]), got["sharded"][1]["losses/approx_kl"]
    if "module rng" in got:
        assert not replay_matched(got["module rng"][1])


def test_two_processes_train_what_one_process_with_4_devices_trains(runs, tmp_path):
    """2 processes of 2 CPU devices each (gloo collectives), started as on a cluster: the runs
    they saved, one folder per --sweep configuration, equal the 4-device run's."""
    script, got = runs
    if script is not ppo_nnx:
        pytest.skip(
            "run with ppo_nnx.py only: the scripts share this code, and time is short"
        )
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    args = seeds_args(script)
    flags = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if v != getattr(script.Args, k) and k != "sweep"
    ] + ["--save-model", "--sweep", *args.sweep]
    processes = [
        subprocess.Popen(
            [sys.executable, script.__file__, *flags],
            cwd=tmp_path,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={
                **devices_env(2),
                "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(i),
            },
        )
        for i in range(2)
    ]
    (out0, err0), (out1, _) = [p.communicate(timeout=300) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], err0[-3000:]
    assert "summary:" in out0 and "summary:" not in out1  # only process 0 prints
    (run_dir,) = (tmp_path / "runs").iterdir()
    configs = [run_dir / script.config_name(config) for config in args.configs]
    saved = [script.load_run(script.Args(eval_checkpoint=str(c)))[1] for c in configs]
    params = [np.concatenate(x) for x in zip(*map(jax.tree.leaves, saved))]
    assert same_params(params, got["seeds"][0])
    assert not same_params(
        params, [np.roll(x, 1, 0) for x in got["seeds"][0]]
    )  # control


def test_devices_must_divide_seeds_or_envs():
    """With 4 devices: one line naming both numbers; a single seed runs on one device."""
    code = (
        "import ppo_nnx as P\n"
        "print(len(P.devices(P.Args())))\n"
        "for args in [P.Args(num_seeds=6), P.Args(num_envs=6, shard_envs=True)]:\n"
        "    try: P.check_args(args)\n"
        "    except ValueError as error: print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=devices_env(4),
        text=True,
        capture_output=True,
        timeout=120,
        cwd=HERE.parent,
    )
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and lines[0] == "1", result.stdout + result.stderr
    assert lines[1].startswith("--num-seeds 6 must be a multiple of the 4 devices (")
    assert lines[2].startswith("--num-envs 6 must be a multiple of the 4 devices (")
