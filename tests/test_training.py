"""The real training loop: replay matches in every epoch and minibatch, and CartPole learns."""

import jax
import numpy as np
import pytest

import ppo_nnx as P
from test_replay import ModuleRngBottleneck

METRIC_KEYS = {
    "global_step", "charts/episodic_return", "charts/episodic_length", "charts/learning_rate",
    "losses/value_loss", "losses/policy_loss", "losses/entropy", "losses/old_approx_kl",
    "losses/approx_kl", "losses/clipfrac", "losses/explained_variance",
}


def tiny_args(**overrides) -> P.Args:
    """7 iterations of 32 steps: past Pendulum's 200-step limit, so every env sees an end."""
    settings = dict(num_envs=4, num_steps=32, num_minibatches=4, update_epochs=2,
                    total_timesteps=4 * 32 * 7, hidden_size=16, latent_size=8)
    return P.Args(**{**settings, **overrides})


def train_seeds(args: P.Args, num_seeds: int = 2):
    keys = jax.vmap(jax.random.key)(np.arange(num_seeds))
    return jax.jit(jax.vmap(P.make_train(args)))(keys)


@pytest.fixture(scope="module", params=["CartPole-v1", "Pendulum-v1"])
def frozen_run(request):
    """learning_rate=0: parameters never move, so every replay must match its rollout."""
    args = tiny_args(env_id=request.param, learning_rate=0.0)
    return args, train_seeds(args)


def test_metrics_interface(frozen_run):
    args, (_, metrics) = frozen_run
    assert METRIC_KEYS <= set(metrics)
    for key, value in metrics.items():
        assert value.shape == (2, args.num_iterations), key
    np.testing.assert_array_equal(
        metrics["global_step"][0], args.batch_size * np.arange(1, args.num_iterations + 1))


def replay_matched(metrics) -> bool:
    """Parameters unchanged, so the ratio must be 1 in every epoch, minibatch and iteration."""
    approx_kl = np.asarray(metrics["losses/approx_kl"])
    clipfrac = np.asarray(metrics["losses/clipfrac"])
    return bool(np.all(approx_kl <= 1e-6) and np.all(clipfrac == 0.0))


def test_replay_matches_in_every_iteration(frozen_run):
    _, (_, metrics) = frozen_run
    assert np.isfinite(metrics["charts/episodic_return"]).any(axis=-1).all()  # episodes ended
    assert replay_matched(metrics), (metrics["losses/approx_kl"], metrics["losses/clipfrac"])


def test_seeds_differ(frozen_run):
    _, (_, metrics) = frozen_run
    assert not np.allclose(metrics["losses/value_loss"][0], metrics["losses/value_loss"][1])


def test_negative_control_module_rng_shows_in_training(monkeypatch):
    """The same training-loop check fails when the bottleneck draws from a module-level RNG."""
    monkeypatch.setattr(P, "VariationalBottleneck", ModuleRngBottleneck)
    _, metrics = train_seeds(tiny_args(learning_rate=0.0), num_seeds=1)
    assert not replay_matched(metrics)
    assert np.all(np.asarray(metrics["losses/approx_kl"]) > 1e-6), metrics["losses/approx_kl"]


def test_learning_rate_anneals_linearly():
    args = tiny_args(learning_rate=1e-3, total_timesteps=4 * 32 * 5)
    _, learning_rate = P.make_optimizer(args)
    got = np.array([learning_rate(i) for i in range(args.num_iterations)])
    np.testing.assert_allclose(got, 1e-3 * (1 - np.arange(5) / 5), rtol=1e-6)


def test_cartpole_learns():
    """Random play scores about 22 on CartPole; a short run must clear that by far."""
    train = jax.jit(P.make_train(P.Args(total_timesteps=100_000)))
    _, metrics = train(jax.random.key(0))
    assert metrics["charts/episodic_return"].shape == (195,)  # one seed: no leading axis
    final = P.final_return(metrics)
    assert final > 150, final
