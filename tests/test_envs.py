"""Every registered gymnax env trains through `main`, or is refused in one line with exit code 2;
an env named by its import path trains as the same env from the registry."""

import dataclasses
import urllib.error

import gymnax
import gymnax.utils.load_mnist
import numpy as np
import pytest
from gymnax.environments.classic_control.cartpole import CartPole

import ppo_nnx
import ppo_nnx_vae_lstm
from conftest import tiny_args, train

TINY = dict(
    num_envs=2,
    num_steps=8,
    num_minibatches=2,
    update_epochs=1,
    total_timesteps=32,
    hidden_size=8,
)
# Refused where its data cannot be fetched (MNISTBandit downloads MNIST when it is built).
MAY_BE_REFUSED = {"MNISTBandit-bsuite": "could not build it"}
# The recurrent script shares ppo_nnx.py's env code; its other tests train CartPole and Pendulum.
# Here: bounds given as jax arrays, a Discrete observation, and the refusal.
RECURRENT = ["Reacher-misc", "FrozenLake-misc", "MNISTBandit-bsuite"]
CARTPOLE = "gymnax.environments.classic_control.cartpole:CartPole"  # by import path
CASES = [(ppo_nnx, env_id) for env_id in gymnax.registered_envs] + [
    (ppo_nnx_vae_lstm, env_id) for env_id in RECURRENT + [CARTPOLE]
]
# --encoder conv, on images [10, 10, C]
CONV = [(script, "Asterix-MinAtar") for script in (ppo_nnx, ppo_nnx_vae_lstm)]


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


@pytest.mark.parametrize("script, env_id", CONV, ids=[s.__name__ for s, _ in CONV])
def test_image_env_trains_through_the_cnn(script, env_id, capsys):
    script.main(script.Args(env_id=env_id, encoder="conv", **TINY))
    assert f"summary: env={env_id} " in capsys.readouterr().out


class ShortCartPole(CartPole):
    """The control: CartPole-v1's dynamics behind an import path, its episodes cut at 20 steps."""

    @property
    def default_params(self):
        return super().default_params.replace(max_steps_in_episode=20)


def test_an_env_named_by_import_path_trains_as_from_the_registry():
    """`--env-id package.module:Class` builds that class: CartPole's trains as CartPole-v1, bit
    for bit; a CartPole with a 20-step time limit does not (the control)."""
    args = tiny_args(ppo_nnx, num_steps=64)
    registered = train(ppo_nnx, args)
    by_path = train(ppo_nnx, dataclasses.replace(args, env_id=CARTPOLE))
    short = train(ppo_nnx, dataclasses.replace(args, env_id="test_envs:ShortCartPole"))
    assert registered.keys() == by_path.keys()
    assert all(
        np.array_equal(registered[k], by_path[k], equal_nan=True) for k in by_path
    )
    assert not np.array_equal(
        short["charts/episodic_length"],
        by_path["charts/episodic_length"],
        equal_nan=True,
    )
    assert (
        np.nanmax(short["charts/episodic_length"])
        <= 20
        < np.nanmax(registered["charts/episodic_length"])
    )


@pytest.mark.parametrize(
    "env_id, message",
    [
        (
            "no_such_package.envs:Env",
            "cannot import no_such_package.envs (No module named",
        ),
        ("gymnax:NoSuchEnv", "gymnax has no NoSuchEnv"),
        ("math:pi", "could not build it ("),
        ("CartPol-v1", "is not a gymnax environment (nor package.module:Class)"),
    ],
)
def test_a_wrong_env_id_is_refused_in_one_line(script, env_id, message):
    with pytest.raises(ValueError) as error:
        script.check_args(script.Args(env_id=env_id))
    line = str(error.value).replace(repr(env_id), env_id)
    assert (
        line.startswith(f"--env-id {env_id}") and message in line and "\n" not in line
    )
    # the control: a path that resolves passes
    assert script.check_args(script.Args(env_id=CARTPOLE)).env_id == CARTPOLE
