"""Both scripts through their real training loop (`run`): frozen parameters replay exactly in
every epoch and minibatch, a module-level RNG is caught there too, and CartPole learns."""

import numpy as np
import pytest

import ppo_nnx
import ppo_nnx_vae_lstm
from conftest import module_rng_bottleneck, replay_matched, tiny_args, train

METRIC_KEYS = {
    "global_step",
    "charts/episodic_return",
    "charts/episodic_length",
    "charts/learning_rate",
    "losses/value_loss",
    "losses/policy_loss",
    "losses/entropy",
    "losses/old_approx_kl",
    "losses/approx_kl",
    "losses/clipfrac",
    "losses/explained_variance",
    "losses/kl",
}
FROZEN = [
    (ppo_nnx, "CartPole-v1", False),
    (ppo_nnx, "Pendulum-v1", False),
    (ppo_nnx_vae_lstm, "CartPole-v1", True),
    (ppo_nnx_vae_lstm, "Pendulum-v1", False),
]


@pytest.fixture(
    scope="module",
    params=FROZEN,
    ids=[f"{s.__name__}-{e}{'-masked' if m else ''}" for s, e, m in FROZEN],
)
def frozen_run(request):
    """learning_rate=0: the parameters never move, so every replay must match its rollout (on
    Pendulum too, whose normalization statistics move on)."""
    script, env_id, mask_velocity = request.param
    norm = env_id == "Pendulum-v1"  # statistics that change every step, as by default
    args = tiny_args(
        script,
        env_id=env_id,
        mask_velocity=mask_velocity,
        learning_rate=0.0,
        latent_size=8,
        num_seeds=2,
        norm_obs=norm,
        norm_reward=norm,
    )
    return args, train(script, args)


def test_metrics_interface(frozen_run):
    args, metrics = frozen_run
    assert set(metrics) == METRIC_KEYS
    for key, value in metrics.items():
        assert value.shape == (2, args.num_iterations), key
    np.testing.assert_array_equal(
        metrics["global_step"][0],
        args.batch_size * np.arange(1, args.num_iterations + 1),
    )


def test_replay_matches_in_every_iteration(frozen_run):
    _, metrics = frozen_run
    assert (
        np.isfinite(metrics["charts/episodic_return"]).any(axis=-1).all()
    )  # episodes ended
    assert replay_matched(metrics), (
        metrics["losses/approx_kl"],
        metrics["losses/clipfrac"],
    )


def test_seeds_differ(frozen_run):
    _, metrics = frozen_run
    assert not np.allclose(
        metrics["losses/value_loss"][0], metrics["losses/value_loss"][1]
    )


def test_negative_control_module_rng_shows_in_training(script, monkeypatch):
    """The same check fails when the bottleneck draws from its module-level nnx.Rngs."""
    monkeypatch.setattr(script, "VariationalBottleneck", module_rng_bottleneck(script))
    metrics = train(script, tiny_args(script, learning_rate=0.0, latent_size=8))
    assert not replay_matched(metrics)
    assert np.all(metrics["losses/approx_kl"] > 1e-6), metrics["losses/approx_kl"]


def test_learning_rate_anneals_linearly():
    args = tiny_args(ppo_nnx, learning_rate=1e-3, total_timesteps=4 * 32 * 5)
    _, learning_rate = ppo_nnx.make_optimizer(args)
    got = np.array([learning_rate(i) for i in range(args.num_iterations)])
    np.testing.assert_allclose(got, 1e-3 * (1 - np.arange(5) / 5), rtol=1e-6)
    _, constant = ppo_nnx.make_optimizer(
        tiny_args(ppo_nnx, learning_rate=1e-3, anneal_lr=False)
    )
    assert not np.allclose(
        [constant(i) for i in range(5)], got
    )  # control: no annealing


@pytest.mark.parametrize(
    "script, total_timesteps",
    [(ppo_nnx, 100_000), (ppo_nnx_vae_lstm, 160 * 1024)],
    ids=["ppo_nnx", "ppo_nnx_vae_lstm"],
)
def test_cartpole_learns(script, total_timesteps):
    """Random play scores about 22 on CartPole; a short run with the defaults clears it by far."""
    args = script.Args(total_timesteps=total_timesteps, seed=0)
    final = script.final_return(train(script, args))
    assert final.shape == (1,) and final[0] > 150, final
