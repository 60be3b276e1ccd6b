"""GAE, the action samplers, the bottleneck's keys and the velocity mask, against independent
closed forms, in both scripts (the fixture `script` is each script module in turn)."""

import dataclasses
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import second_rollout, tiny_args


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
    data = dict(
        rewards=rng.normal(size=(T, B)),
        values=rng.normal(size=(T, B)),
        next_values=rng.normal(size=(T, B)),
        terminated=terminated,
        truncated=truncated,
    )
    return {
        k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in data.items()
    }


def run_gae(script, d, terminated):
    steps = SimpleNamespace(
        reward=jnp.asarray(d["rewards"]),
        output={"value": d["values"]},
        terminated=jnp.asarray(terminated),
        truncated=d["truncated"],
    )
    return script.compute_gae(
        steps, jnp.asarray(d["next_values"]), script.Args(gamma=0.99, gae_lambda=0.95)
    )


def test_gae_matches_python_loop(script, episodes):
    advantages, returns = run_gae(script, episodes, episodes["terminated"])
    expected_adv, expected_ret = gae_loop(**episodes, gamma=0.99, lam=0.95)
    np.testing.assert_allclose(advantages, expected_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(returns, expected_ret, rtol=1e-5, atol=1e-5)


def test_negative_control_truncation_as_termination_differs(script, episodes):
    """The classic flaw (a time limit treated as terminal) must not pass the same check."""
    advantages, _ = run_gae(
        script, episodes, episodes["terminated"] | episodes["truncated"]
    )
    expected_adv, _ = gae_loop(**episodes, gamma=0.99, lam=0.95)
    assert not np.allclose(advantages, expected_adv, rtol=1e-5, atol=1e-5)


def test_categorical_sampler_closed_form(script):
    sampler = script.CategoricalSampler(nnx.Rngs(0))
    logits = jnp.array([[0.0, 1.0, 2.0], [3.0, -1.0, 0.5]])
    actions = jnp.array([2, 1])
    out = sampler(sampler.initialize_state(2), logits, rollout_extras=actions)
    p = np.exp(np.asarray(logits)) / np.exp(np.asarray(logits)).sum(-1, keepdims=True)
    np.testing.assert_allclose(
        out.output["log_prob"], np.log(p[[0, 1], [2, 1]]), rtol=1e-6
    )
    np.testing.assert_allclose(
        out.output["entropy"], -(p * np.log(p)).sum(-1), rtol=1e-6
    )
    np.testing.assert_array_equal(out.rollout_extras, actions)
    # negative control: another action's log-probability does not pass the same check
    other = sampler(
        sampler.initialize_state(2), logits, rollout_extras=jnp.array([0, 0])
    )
    assert not np.allclose(
        other.output["log_prob"], np.log(p[[0, 1], [2, 1]]), rtol=1e-6
    )


def test_categorical_sampler_frequencies(script):
    sampler = script.CategoricalSampler(nnx.Rngs(0))
    logits = jnp.tile(jnp.array([[0.0, 1.0, 2.0]]), (20_000, 1))
    out = sampler(sampler.initialize_state(20_000), logits)
    frequencies = np.bincount(np.asarray(out.output["action"]), minlength=3) / 20_000
    np.testing.assert_allclose(
        frequencies, np.exp([0, 1, 2]) / np.exp([0, 1, 2]).sum(), atol=0.015
    )


def test_gaussian_sampler_closed_form(script):
    sampler = script.GaussianSampler(2, (-1.0, -2.0), (1.0, 2.0), nnx.Rngs(0))
    sampler.log_std[...] = jnp.array([-0.5, 0.3])
    std = np.exp([-0.5, 0.3])
    mean = jnp.array([[0.0, 1.0], [2.0, -3.0]])
    raw = jnp.array([[0.5, 0.0], [3.5, -5.0]])  # second row lies outside the bounds
    out = sampler(sampler.initialize_state(2), mean, rollout_extras=raw)
    z = (np.asarray(raw) - np.asarray(mean)) / std
    expected = (-0.5 * z**2 - np.log(std) - 0.5 * math.log(2 * math.pi)).sum(-1)
    np.testing.assert_allclose(out.output["log_prob"], expected, rtol=1e-6)
    np.testing.assert_allclose(
        out.output["entropy"],
        [np.sum(0.5 * np.log(2 * math.pi * math.e * std**2))] * 2,
        rtol=1e-6,
    )
    # the env gets the clipped action, replay scores the raw one
    np.testing.assert_allclose(out.output["action"], [[0.5, 0.0], [1.0, -2.0]])
    np.testing.assert_allclose(out.rollout_extras, raw)
    # negative control: scoring the clipped action gives another density
    clipped = sampler(
        sampler.initialize_state(2), mean, rollout_extras=out.output["action"]
    )
    assert not np.allclose(clipped.output["log_prob"], expected, rtol=1e-6)


NUMPY_ACTIVATIONS = {"tanh": np.tanh, "relu": lambda x: np.maximum(x, 0.0)}


@pytest.mark.parametrize("activation, other", [("tanh", "relu"), ("relu", "tanh")])
def test_activation_between_hidden_layers(script, activation, other):
    """--activation is the nonlinearity of every hidden layer: an mlp against numpy."""
    net = script.mlp([3, 8, 8, 2], 1.0, script.ACTIVATIONS[activation], nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)

    def forward(f):
        h = x
        for i, layer in enumerate(
            layer for layer in net.layers if isinstance(layer, nnx.Linear)
        ):
            h = h @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...])
            h = f(h) if i < 2 else h  # none after the output layer
        return h

    np.testing.assert_allclose(
        net(jnp.asarray(x)),
        forward(NUMPY_ACTIVATIONS[activation]),
        rtol=1e-5,
        atol=1e-6,
    )
    # negative control: the other nonlinearity gives other outputs
    assert not np.allclose(
        net(jnp.asarray(x)), forward(NUMPY_ACTIVATIONS[other]), atol=1e-3
    )


@pytest.mark.parametrize(
    "activation, bias, varies",
    [("relu", 100.0, True), ("relu", -100.0, False), ("tanh", 100.0, False)],
)  # negative control: tanh saturates where relu passes
def test_activation_after_the_first_block(script, activation, bias, varies):
    """The actor's first block (ppo_nnx.py's torso, the recurrent script's encoder) ends in
    --activation too: relu passes outputs pushed far positive (the policy still depends on the
    observation) and cuts those pushed far negative to zero (then it does not)."""
    args = script.check_args(script.Args(activation=activation, latent_size=0))
    model = script.build_model(args, *script.make_env(args), nnx.Rngs(0))
    first = model.actor_torso if hasattr(model, "actor_torso") else model.encoder
    last = [layer for layer in first.layers if isinstance(layer, nnx.Linear)][-1]
    last.bias[...] = jnp.full_like(last.bias[...], bias)
    obs = jnp.asarray(np.random.default_rng(0).normal(size=(6, 4)), jnp.float32)
    entropy = np.asarray(model(model.initialize_state(6), obs).output["entropy"])
    assert (len(np.unique(entropy)) > 1) == varies, (
        entropy
    )  # saturated or cut: identical bits


def test_gaussian_sampler_moments(script):
    sampler = script.GaussianSampler(1, (-100.0,), (100.0,), nnx.Rngs(0))
    sampler.log_std[...] = jnp.array([math.log(0.7)])
    out = sampler(sampler.initialize_state(20_000), jnp.full((20_000, 1), 1.5))
    raw = np.asarray(out.rollout_extras)[:, 0]
    assert abs(raw.mean() - 1.5) < 0.02 and abs(raw.std() - 0.7) < 0.02


def test_bottleneck_key_carry_advances_per_env(script):
    bottleneck = script.VariationalBottleneck(4, 3, 1.0, nnx.Rngs(0))
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


@pytest.mark.parametrize(
    "env_id, keep", [("CartPole-v1", [0, 2]), ("Pendulum-v1", [0, 1])]
)
def test_mask_velocity_keeps_positions_only(script, env_id, keep):
    """What the network sees with --mask-velocity: positions only, final observations too."""
    args = tiny_args(script, env_id=env_id, mask_velocity=True, num_steps=60)
    env, env_params = script.make_env(args)
    obs = jax.random.normal(
        jax.random.key(0), (3,) + env.observation_space(env_params).shape
    )
    np.testing.assert_array_equal(script.observe(obs, args), obs[:, np.array(keep)])
    masked = np.asarray(script.observe(obs, args))
    velocities = [i for i in range(obs.shape[1]) if i not in keep]
    assert not any(
        np.allclose(masked[:, j], obs[:, v]) for j in range(2) for v in velocities
    )
    unmasked = script.observe(obs, dataclasses.replace(args, mask_velocity=False))
    np.testing.assert_array_equal(
        unmasked, obs
    )  # control: without the flag, everything
    t = second_rollout(
        script,
        args,
        env,
        env_params.replace(max_steps_in_episode=20),
        jax.random.key(1),
    )[3]
    assert t.obs.shape[-1] == t.final_obs.shape[-1] == 2
    done = np.asarray(t.terminated | t.truncated)[:-1]
    assert done.any()
    np.testing.assert_array_equal(
        np.asarray(t.final_obs)[:-1][~done], np.asarray(t.obs)[1:][~done]
    )


def test_mask_velocity_is_refused_elsewhere(script):
    with pytest.raises(ValueError, match="--mask-velocity supports"):
        script.make_env(script.Args(env_id="Acrobot-v1", mask_velocity=True))


def test_conv_encoder_reads_images_whole(script):
    """--encoder conv: observations stay images [B, 10, 10, C], and the CNN turns them into
    [B, 5 * 5 * 32] features for the MLPs; without it they are flattened (the control)."""
    inputs, features = {}, {}
    for encoder in ("conv", "mlp"):
        args = script.check_args(
            tiny_args(script, env_id="Breakout-MinAtar", encoder=encoder)
        )
        env, env_params = script.make_env(args)
        obs = script.observe(env.reset(jax.random.key(0), env_params)[0][None], args)
        model = script.build_model(args, env, env_params, nnx.Rngs(0))
        inputs[encoder], features[encoder] = obs.shape, model.features(obs).shape
    assert inputs["conv"] == (1, 10, 10, 4) and features["conv"] == (1, 5 * 5 * 32)
    assert inputs["mlp"] == features["mlp"] == (1, 400)


@pytest.mark.parametrize("stride", [1, 2])
def test_patches_times_a_kernel_is_a_convolution(script, stride):
    """`patches` then a matrix product: XLA's own 3x3 SAME convolution, on images with two batch
    axes and odd sizes. Control: the kernel flipped left to right."""
    x = jax.random.normal(jax.random.key(0), (2, 3, 9, 7, 4))
    kernel = jax.random.normal(jax.random.key(1), (3, 3, 4, 5))
    got = script.patches(x, stride) @ kernel.reshape(-1, 5)
    dims = ("NHWC", "HWIO", "NHWC")

    def convolution(k):
        images = x.reshape((-1,) + x.shape[2:])
        out = jax.lax.conv_general_dilated(
            images, k, (stride, stride), "SAME", dimension_numbers=dims
        )
        return out.reshape(got.shape)

    np.testing.assert_allclose(got, convolution(kernel), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, convolution(kernel[:, ::-1]), atol=1e-2)
