"""ppo_nnx_vae_lstm.py through its real training loop: frozen replay matches, and bad sizes fail."""

import jax
import numpy as np
import pytest

import ppo_nnx_vae_lstm as R
from test_replay import module_rng_bottleneck
from test_training import METRIC_KEYS, replay_matched


def tiny_args(**overrides) -> R.Args:
    """7 iterations of 32 steps: past Pendulum's 200-step limit, so every env sees an end."""
    settings = dict(num_envs=4, num_steps=32, num_minibatches=2, update_epochs=2,
                    total_timesteps=4 * 32 * 7, hidden_size=16, lstm_size=16, latent_size=8)
    return R.Args(**{**settings, **overrides})


def train_seeds(args: R.Args, num_seeds: int = 2):
    keys = jax.vmap(jax.random.key)(np.arange(num_seeds))
    return jax.jit(jax.vmap(R.make_train(args)))(keys)


@pytest.fixture(scope="module", params=[("CartPole-v1", True), ("Pendulum-v1", False)],
                ids=["CartPole-v1-masked", "Pendulum-v1"])
def frozen_run(request):
    """learning_rate=0: parameters never move, so every replay must match its rollout."""
    env_id, mask_velocity = request.param
    args = tiny_args(env_id=env_id, mask_velocity=mask_velocity, learning_rate=0.0)
    return args, train_seeds(args)


def test_metrics_interface(frozen_run):
    args, (_, metrics) = frozen_run
    assert METRIC_KEYS | {"losses/kl"} <= set(metrics)
    for key, value in metrics.items():
        assert value.shape == (2, args.num_iterations), key


def test_replay_matches_in_every_iteration(frozen_run):
    _, (_, metrics) = frozen_run
    assert np.isfinite(metrics["charts/episodic_return"]).any(axis=-1).all()  # episodes ended
    assert replay_matched(metrics), (metrics["losses/approx_kl"], metrics["losses/clipfrac"])


def test_negative_control_module_rng_shows_in_training(monkeypatch):
    """The same training-loop check fails when the bottleneck draws from a module-level RNG."""
    monkeypatch.setattr(R, "VariationalBottleneck", module_rng_bottleneck(R))
    _, metrics = train_seeds(tiny_args(learning_rate=0.0), num_seeds=1)
    assert not replay_matched(metrics)
    assert np.all(np.asarray(metrics["losses/approx_kl"]) > 1e-6), metrics["losses/approx_kl"]


def test_minibatches_must_divide_the_envs(capsys):
    """Minibatches hold whole sequences, so they split the envs, not the batch."""
    with pytest.raises(SystemExit) as exit_info:
        R.main(R.Args(num_envs=6, num_steps=32, num_minibatches=4))  # 4 divides 6 * 32
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num-minibatches 4" in err[0] and "--num-envs 6" in err[0], err


def test_cartpole_learns():
    """Random play scores about 22 on CartPole; a short run with the defaults must clear that."""
    train = jax.jit(R.make_train(R.Args(total_timesteps=160 * 1024)))
    _, metrics = train(jax.random.key(0))
    final = R.final_return(metrics)
    assert final > 150, final
