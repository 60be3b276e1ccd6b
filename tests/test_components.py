"""GAE, the action samplers and the velocity mask against independent closed forms, in both
scripts (the fixture `P` is each script module in turn)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx


def gae_loop(rewards, values, next_values, terminated, truncated, gamma, lam):
    """Textbook GAE, one env and one step at a time."""
    T, B = rewards.shape
    advantages = np.zeros((T, B))
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            bootstrap = 0.0 if terminated[t, b] else gamma * next_values[t, b]
            delta = rewards[t, b] + bootstrap - values[t, b]
            if terminated[t, b] or truncated[t, b]:
                running = 0.0  # the next step belongs to another episode
            running = delta + gamma * lam * running
            advantages[t, b] = running
    return advantages, advantages + values


@pytest.fixture(scope="module")
def episodes():
    rng = np.random.default_rng(0)
    T, B = 40, 3
    terminated = rng.random((T, B)) < 0.1
    truncated = (rng.random((T, B)) < 0.1) & ~terminated
    truncated[5, 0] = terminated[9, 0] = True  # both kinds certainly present
    data = dict(rewards=rng.normal(size=(T, B)), values=rng.normal(size=(T, B)),
                next_values=rng.normal(size=(T, B)), terminated=terminated, truncated=truncated)
    return {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in data.items()}


def run_gae(P, d, terminated):
    return P.compute_gae(jnp.asarray(d["rewards"]), jnp.asarray(d["values"]),
                         jnp.asarray(d["next_values"]), jnp.asarray(terminated),
                         jnp.asarray(d["truncated"]), 0.99, 0.95)


def test_gae_matches_python_loop(P, episodes):
    advantages, returns = run_gae(P, episodes, episodes["terminated"])
    expected_adv, expected_ret = gae_loop(**episodes, gamma=0.99, lam=0.95)
    np.testing.assert_allclose(advantages, expected_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(returns, expected_ret, rtol=1e-5, atol=1e-5)


def test_negative_control_truncation_as_termination_differs(P, episodes):
    """The classic flaw (a time limit treated as terminal) must not pass the same check."""
    advantages, _ = run_gae(P, episodes, episodes["terminated"] | episodes["truncated"])
    expected_adv, _ = gae_loop(**episodes, gamma=0.99, lam=0.95)
    assert not np.allclose(advantages, expected_adv, rtol=1e-5, atol=1e-5)


def test_categorical_sampler_closed_form(P):
    sampler = P.CategoricalSampler(nnx.Rngs(0))
    logits = jnp.array([[0.0, 1.0, 2.0], [3.0, -1.0, 0.5]])
    actions = jnp.array([2, 1])
    out = sampler(sampler.initialize_state(2), logits, rollout_extras=actions)
    p = np.exp(np.asarray(logits)) / np.exp(np.asarray(logits)).sum(-1, keepdims=True)
    np.testing.assert_allclose(out.output["log_prob"], np.log(p[[0, 1], [2, 1]]), rtol=1e-6)
    np.testing.assert_allclose(out.output["entropy"], -(p * np.log(p)).sum(-1), rtol=1e-6)
    np.testing.assert_array_equal(out.rollout_extras, actions)
    # negative control: another action's log-probability does not pass the same check
    other = sampler(sampler.initialize_state(2), logits, rollout_extras=jnp.array([0, 0]))
    assert not np.allclose(other.output["log_prob"], np.log(p[[0, 1], [2, 1]]), rtol=1e-6)


def test_categorical_sampler_frequencies(P):
    sampler = P.CategoricalSampler(nnx.Rngs(0))
    logits = jnp.tile(jnp.array([[0.0, 1.0, 2.0]]), (20_000, 1))
    out = sampler(sampler.initialize_state(20_000), logits)
    frequencies = np.bincount(np.asarray(out.output["action"]), minlength=3) / 20_000
    np.testing.assert_allclose(frequencies, np.exp([0, 1, 2]) / np.exp([0, 1, 2]).sum(), atol=0.015)


def test_gaussian_sampler_closed_form(P):
    sampler = P.GaussianSampler(2, (-1.0, -2.0), (1.0, 2.0), nnx.Rngs(0))
    sampler.log_std[...] = jnp.array([-0.5, 0.3])
    std = np.exp([-0.5, 0.3])
    mean = jnp.array([[0.0, 1.0], [2.0, -3.0]])
    raw = jnp.array([[0.5, 0.0], [3.5, -5.0]])  # second row lies outside the bounds
    out = sampler(sampler.initialize_state(2), mean, rollout_extras=raw)
    z = (np.asarray(raw) - np.asarray(mean)) / std
    expected = (-0.5 * z**2 - np.log(std) - 0.5 * math.log(2 * math.pi)).sum(-1)
    np.testing.assert_allclose(out.output["log_prob"], expected, rtol=1e-6)
    np.testing.assert_allclose(out.output["entropy"],
                               [np.sum(0.5 * np.log(2 * math.pi * math.e * std**2))] * 2, rtol=1e-6)
    # the env gets the clipped action, replay scores the raw one
    np.testing.assert_allclose(out.output["action"], [[0.5, 0.0], [1.0, -2.0]])
    np.testing.assert_allclose(out.rollout_extras, raw)
    # negative control: scoring the clipped action gives another density
    clipped = sampler(sampler.initialize_state(2), mean, rollout_extras=out.output["action"])
    assert not np.allclose(clipped.output["log_prob"], expected, rtol=1e-6)


def test_gaussian_sampler_moments(P):
    sampler = P.GaussianSampler(1, (-100.0,), (100.0,), nnx.Rngs(0))
    sampler.log_std[...] = jnp.array([math.log(0.7)])
    out = sampler(sampler.initialize_state(20_000), jnp.full((20_000, 1), 1.5))
    raw = np.asarray(out.rollout_extras)[:, 0]
    assert abs(raw.mean() - 1.5) < 0.02 and abs(raw.std() - 0.7) < 0.02


def test_bottleneck_key_carry_advances_per_env(P):
    bottleneck = P.VariationalBottleneck(4, 3, 1.0, nnx.Rngs(0))
    keys = bottleneck.initialize_state(5)
    assert keys.shape == (5,)
    x = jnp.ones((5, 4))
    first = bottleneck(keys, x)
    again = bottleneck(keys, x)
    second = bottleneck(first.next_state, x)
    np.testing.assert_array_equal(first.output, again.output)  # same key, same draw
    assert not np.allclose(first.output, second.output)  # the chain moves on
    assert not np.allclose(first.output[0], first.output[1])  # envs draw independently
    # a single env's draw does not depend on the batch it is sliced into
    alone = bottleneck(keys[2:3], x[2:3])
    np.testing.assert_allclose(alone.output[0], first.output[2], atol=1e-6)


@pytest.mark.parametrize("env_id, keep", [("CartPole-v1", [0, 2]), ("Pendulum-v1", [0, 1])])
def test_mask_velocity_keeps_positions_only(P, env_id, keep):
    """Reset, step and the pre-reset final observation all lose exactly the velocity entries."""
    env, params = P.make_env(env_id)
    masked, _ = P.make_env(env_id, mask_velocity=True)
    params = params.replace(max_steps_in_episode=3)  # an episode end within the loop below
    assert masked.observation_space(params).shape == (2,)
    key = jax.random.key(0)
    obs, state = env.reset(key, params)
    masked_obs, masked_state = masked.reset(key, params)
    np.testing.assert_array_equal(masked_obs, obs[np.array(keep)])
    action = env.action_space(params).sample(key)
    for _ in range(4):
        key, step_key = jax.random.split(key)
        obs, state, *_, info = env.step(step_key, state, action, params)
        masked_obs, masked_state, *_, masked_info = masked.step(step_key, masked_state, action,
                                                                params)
        np.testing.assert_array_equal(masked_obs, obs[np.array(keep)])
        np.testing.assert_array_equal(masked_info["final_observation"],
                                      info["final_observation"][np.array(keep)])
    # negative control: the velocities are not what the mask kept
    assert not np.allclose(masked_info["final_observation"], info["final_observation"][np.array([1, 2])])
