"""Every registered gymnax env trains through `main`, or is refused in one line with exit code 2."""

import urllib.error

import gymnax
import gymnax.utils.load_mnist
import pytest

import ppo_nnx
import ppo_nnx_vae_lstm

TINY = dict(
    num_envs=2,
    num_steps=8,
    num_minibatches=2,
    update_epochs=1,
    total_timesteps=32,
    hidden_size=8,
)
# Refused where its data cannot be fetched (MNISTBandit downloads MNIST when it is built).
MAY_BE_REFUSED = {"MNISTBandit-bsuite": "gymnax could not build it"}
# The recurrent script shares ppo_nnx.py's env code; its other tests train CartPole and Pendulum.
# Here: bounds given as jax arrays, a Discrete observation, and the refusal.
RECURRENT = ["Reacher-misc", "FrozenLake-misc", "MNISTBandit-bsuite"]
CASES = [(ppo_nnx, env_id) for env_id in gymnax.registered_envs] + [
    (ppo_nnx_vae_lstm, env_id) for env_id in RECURRENT
]


@pytest.mark.parametrize(
    "script, env_id", CASES, ids=[f"{s.__name__}-{e}" for s, e in CASES]
)
def test_env_trains_or_is_refused(script, env_id, capsys, monkeypatch):
    def offline(url, filename):  # the test never reaches for the network
        raise urllib.error.URLError("offline (test)")

    monkeypatch.setattr(gymnax.utils.load_mnist, "urlretrieve", offline)
    try:
        script.main(script.Args(env_id=env_id, **TINY))
    except SystemExit as exit_info:
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.code == 2 and env_id in MAY_BE_REFUSED, err
        assert len(err) == 1 and err[0].startswith(f"error: --env-id {env_id}"), err
        assert MAY_BE_REFUSED[env_id] in err[0]
        return
    out = capsys.readouterr().out
    assert f"summary: env={env_id} " in out and "env_steps=32 " in out, out
