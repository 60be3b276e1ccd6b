"""Observation and reward normalization: the running statistics, their defaults, each seed's own,
and replay, which must see the statistics the rollout used and fails with later ones."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ppo_nnx
from conftest import TOL, start, tiny_args


def test_moments_merge_batches_as_one_stream():
    """Batch by batch, the running moments are those of all the data seen (gym's RunningMeanStd,
    whose prior count of 1e-4 is too small to show)."""
    rng = np.random.default_rng(0)
    data = (
        rng.normal(0.0, 2.0, (10, 16, 3)) + rng.normal(0.0, 5.0, (10, 1, 3))
    ).astype(np.float32)
    moments = dict(mean=jnp.zeros(3), var=jnp.ones(3), count=jnp.array(1e-4))
    for batch in data:
        moments = ppo_nnx.update_moments(moments, jnp.asarray(batch))
    flat = data.reshape(-1, 3)
    np.testing.assert_allclose(moments["mean"], flat.mean(0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(moments["var"], flat.var(0), rtol=1e-4)
    assert float(moments["count"]) == pytest.approx(160, abs=1e-3)
    # control: a merge that averages the batches' variances misses the spread of their means
    assert not np.allclose(data.var(1).mean(0), flat.var(0), rtol=1e-4)


@pytest.mark.parametrize(
    "env_id, continuous",
    [
        ("CartPole-v1", False),
        ("Acrobot-v1", False),
        ("Pendulum-v1", True),
        ("MountainCarContinuous-v0", True),
    ],
)
def test_defaults_follow_the_action_space(script, env_id, continuous):
    args = script.check_args(script.Args(env_id=env_id))
    assert (args.norm_obs, args.norm_reward) == (continuous, continuous)
    chosen = script.check_args(script.Args(env_id=env_id, norm_obs=not continuous))
    assert (chosen.norm_obs, chosen.norm_reward) == (
        not continuous,
        continuous,
    )  # a flag wins


def test_replay_needs_the_statistics_the_rollout_used(script):
    """Replay gives back the rollout's log-probs from the stored (normalized) observations. A
    network that normalized inside its call would see, at replay, the statistics as they are after
    the rollout: the same check fails with those."""
    args = tiny_args(script, env_id="Pendulum-v1", norm_obs=True, norm_reward=True)
    env, env_params = script.make_env(args)
    graphdef, params, rest, runner = start(
        script, args, env, env_params, jax.random.key(0)
    )
    step = jax.jit(
        lambda runner: script.rollout(
            graphdef,
            params,
            rest,
            env,
            env_params,
            runner,
            dataclasses.replace(args, num_steps=1),
        )
    )
    raw, steps = [], []
    for _ in range(args.num_steps):  # one step at a time, to see the statistics of each
        stats = runner.norm.obs
        raw.append(
            runner.obs * jnp.sqrt(stats["var"] + 1e-8) + stats["mean"]
        )  # the env's
        runner, t = step(runner)
        steps.append(t)
    t = jax.tree.map(lambda *x: jnp.concatenate(x), *steps)
    assert np.abs(t.obs).max() < 10  # nothing clipped: `raw` is exact

    def replayed_difference(t):
        out = script.replay(
            graphdef, params, rest, script.rollout_batch(t, t.reward, t.reward)
        )
        return float(
            jnp.abs(
                out.output["log_prob"].reshape(-1) - t.output["log_prob"].reshape(-1)
            ).max()
        )

    assert replayed_difference(t) <= TOL
    late = t._replace(
        obs=jnp.stack([script.observe(obs, args, runner.norm) for obs in raw])
    )
    assert replayed_difference(late) > 1e-3  # control: the post-update statistics


def test_each_seed_keeps_its_own_statistics():
    """Vmapped seeds update their own statistics: seed 2 of a 2-seed run has those of seed 2
    alone (to the vmapped-seed tolerance of test_reliability), and not seed 1's."""
    args = tiny_args(ppo_nnx, env_id="Pendulum-v1", norm_obs=True, norm_reward=True)
    both = ppo_nnx.run(dataclasses.replace(args, seed=1, num_seeds=2))[0][2].norm
    alone = ppo_nnx.run(dataclasses.replace(args, seed=2))[0][2].norm
    for got, want in zip(jax.tree.leaves(both), jax.tree.leaves(alone)):
        np.testing.assert_allclose(got[1], want[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(
        both.obs["mean"][0], both.obs["mean"][1]
    )  # control: the other seed
    assert not np.allclose(both.ret["var"][0], both.ret["var"][1])
