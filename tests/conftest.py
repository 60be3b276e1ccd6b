"""Helpers shared by the test modules: each name here means one thing in the whole suite."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ppo_nnx
import ppo_nnx_vae_lstm

TOL = 1e-6  # replay equality holds to float32 rounding, not bit for bit: see `rounding`
# A tiny run on the command line: one compile of a few seconds, 8 iterations.
TINY_FLAGS = [
    "--total-timesteps",
    "1024",
    "--num-envs",
    "4",
    "--num-steps",
    "32",
    "--num-minibatches",
    "2",
    "--update-epochs",
    "1",
    "--hidden-size",
    "16",
]


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """Every test in a folder of its own: `main` reserves its run folder in ./runs."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(params=[ppo_nnx, ppo_nnx_vae_lstm], ids=lambda module: module.__name__)
def script(request):
    """Each script module in turn, for the tests that hold for both."""
    return request.param


def tiny_args(script, **overrides):
    """Small networks and 7 iterations of 4 envs x 32 steps: past Pendulum's 200-step limit, so
    every env sees an episode end. Minibatches of 2 split both the batch and the envs."""
    settings = dict(
        num_envs=4,
        num_steps=32,
        num_minibatches=2,
        update_epochs=2,
        total_timesteps=4 * 32 * 7,
        hidden_size=16,
    )
    if script is ppo_nnx_vae_lstm:
        settings["lstm_size"] = 16
    return script.Args(**{**settings, **overrides})


def train(script, args):
    """`script.run(args)`'s metrics as numpy arrays, [num_seeds, num_iterations]."""
    return jax.tree.map(np.asarray, script.run(args)[1])


def same_run(a: dict, b: dict) -> bool:
    """The same trajectory up to float reduction order: every episode return equal, every loss
    within 1e-5 relative or 1e-6 absolute (the policy loss averages to nearly zero)."""
    for k in a:
        exact = k.startswith("charts/") or k == "global_step"
        if not np.allclose(
            a[k],
            b[k],
            rtol=0 if exact else 1e-5,
            atol=0 if exact else 1e-6,
            equal_nan=True,
        ):
            return False
    return True


def rounding(a, b):
    """|a - b| relative to |a| above 1: float32 rounding grows with the value (normalized inputs
    give latents of 5 and more, where 1e-6 is 2 ulps)."""
    return jnp.abs(a - b) / jnp.maximum(1.0, jnp.abs(a))


def replay_matched(metrics) -> bool:
    """With the parameters frozen, PPO's ratio must be 1 in every epoch, minibatch and iteration."""
    return bool(
        np.all(np.asarray(metrics["losses/approx_kl"]) <= TOL)
        and np.all(np.asarray(metrics["losses/clipfrac"]) == 0.0)
    )


def module_rng_bottleneck(script):
    """The bug the per-env key carry prevents: a bottleneck drawing eps from its nnx.Rngs."""

    class ModuleRngBottleneck(script.VariationalBottleneck):
        def __call__(self, key, x, rollout_extras=None):
            mean, std = self.mean(x), jax.nn.softplus(self.pre_std(x)) + 1e-6
            eps = jax.random.normal(self.rngs(), mean.shape)
            kl = 0.5 * jnp.sum(mean**2 + std**2 - 1.0 - 2.0 * jnp.log(std), axis=-1)
            return script.Output(
                key, mean + std * eps, self.kl_coef * kl, {"losses/kl": kl.mean()}, ()
            )

    return ModuleRngBottleneck


def start(script, args, env, env_params, key):
    """What `train` builds before its first iteration: (graphdef, params, rest, runner)."""
    init_key, reset_key, runner_key = jax.random.split(key, 3)
    model = script.build_model(args, env, env_params, nnx.Rngs(init_key))
    carry = model.initialize_state(args.num_envs)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(reset_key, args.num_envs), env_params
    )
    norm = script.init_norm(script.observe(obs, args), args)
    runner = script.Runner(
        env_state,
        script.observe(obs, args, norm),
        carry,
        jnp.zeros(args.num_envs),
        jnp.zeros(args.num_envs, int),
        runner_key,
        norm,
    )
    return graphdef, params, rest, runner


def second_rollout(script, args, env, env_params, key):
    """Two rollouts with the script's own functions, so the second starts from a used carry:
    (graphdef, params, rest, its [T, B] transitions)."""
    graphdef, params, rest, runner = start(script, args, env, env_params, key)
    runner, _ = script.rollout(graphdef, params, rest, env, env_params, runner, args)
    return (
        graphdef,
        params,
        rest,
        script.rollout(graphdef, params, rest, env, env_params, runner, args)[1],
    )


def run_cli(script, *flags, cwd=None, env=None, drop=(), timeout=300):
    """`python <script>.py flags...` in a process of its own: the environment is ours, updated
    with `env`, without the variables whose names start with a prefix in `drop`."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(tuple(drop))}
    return subprocess.run(
        [sys.executable, script.__file__, *flags],
        cwd=cwd,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
