"""The suites' adapters (suites.py) step as each suite's own loop does, with the same keys: the
same observations, rewards and final observations, `terminated` where the suite ends an episode
and `truncated` only at its time limit, through both. A wrong adapter (a mutation) fails the same
comparison. Each suite's tests skip where it is not installed (requirements-envs.txt)."""

import base64
import hashlib
import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ppo_nnx
import suites

STEPS = 100  # steps of each env: enough for both a termination and a time limit below
ENVS = 16


def adapter_loop(env, key):
    """gymnax's auto-resetting `step` of the adapter, as the scripts call it: per step and env,
    (obs, reward, terminated, truncated, final_observation)."""
    params = env.default_params
    space = env.action_space(params)

    def step(state, step_key):
        step_keys = jax.random.split(step_key, ENVS)
        actions = jax.vmap(space.sample)(step_keys)
        obs, state, reward, terminated, truncated, info = jax.vmap(
            env.step, (0, 0, 0, None)
        )(step_keys, state, actions, params)
        return state, (obs, reward, terminated, truncated, info["final_observation"])

    @jax.jit
    def loop(key):
        reset_key, key = jax.random.split(key)
        reset_keys = jax.random.split(reset_key, ENVS)
        _, state = jax.vmap(env.reset, (0, None))(reset_keys, params)
        return jax.lax.scan(step, state, jax.random.split(key, STEPS))[1]

    return [np.asarray(x) for x in loop(key)]


def suite_loop(reset, step, env, key):
    """The suite's own loop over the same keys and actions, with gymnax's key split per step:
    `reset(key)` -> (obs, state) and `step(key, state, action)` -> (obs, state, reward,
    terminated, truncated), a reset following where the episode ended."""
    space = env.action_space(env.default_params)

    def loop_step(state, step_key):
        step_keys = jax.random.split(step_key, ENVS)
        actions = jax.vmap(space.sample)(step_keys)
        key_step, key_reset = jax.vmap(jax.random.split, out_axes=1)(step_keys)
        final_obs, state, reward, terminated, truncated = jax.vmap(step)(
            key_step, state, actions
        )
        reset_obs, reset_state = jax.vmap(reset)(key_reset)
        done = terminated | truncated

        def pick(new, old):
            return jnp.where(done.reshape(done.shape + (1,) * (new.ndim - 1)), new, old)

        obs, state = jax.tree.map(pick, (reset_obs, reset_state), (final_obs, state))
        return state, (obs, reward, terminated, truncated, final_obs)

    @jax.jit
    def loop(key):
        reset_key, key = jax.random.split(key)
        _, state = jax.vmap(reset)(jax.random.split(reset_key, ENVS))
        return jax.lax.scan(loop_step, state, jax.random.split(key, STEPS))[1]

    return [np.asarray(x) for x in loop(key)]


def mutant(env, **methods):
    """A copy of the adapter with `methods` replaced: a new object, which gymnax's `step` (jitted
    with the env static) traces anew."""
    cls = type("Mutant", (type(env),), methods)
    copy = cls.__new__(cls)
    copy.__dict__.update(env.__dict__)
    return copy


def assert_same(ours, theirs):
    names = ["obs", "reward", "terminated", "truncated", "final_observation"]
    for name, a, b in zip(names, ours, theirs):
        np.testing.assert_array_equal(a, b, err_msg=name)
    terminated, truncated = ours[2], ours[3]
    assert terminated.any() and truncated.any(), (
        "the steps must reach both ends of an episode"
    )


# xminigrid: MiniGrid-Empty-5x5, where random actions reach the goal within a shortened limit
@pytest.fixture(scope="module")
def xminigrid_env():
    pytest.importorskip("xminigrid")
    env = suites.XMiniGrid("MiniGrid-Empty-5x5")
    env.params = env.params.replace(max_steps=30)
    return env


def xminigrid_loop(env):
    from xminigrid.types import StepType

    raw, params = env.env, env.params

    def reset(key):
        timestep = raw.reset(params, key)
        return timestep.observation, timestep

    def step(key, timestep, action):
        timestep = raw.step(params, timestep, action)
        ended = timestep.step_type == StepType.LAST
        # xminigrid's discount: 0 where the episode terminated, 1 where it was cut
        return (
            timestep.observation,
            timestep,
            timestep.reward,
            ended & (timestep.discount == 0),
            ended & (timestep.discount == 1),
        )

    return suite_loop(reset, step, env, jax.random.key(0))


def test_xminigrid_steps_as_its_own_loop(xminigrid_env):
    assert_same(
        adapter_loop(xminigrid_env, jax.random.key(0)), xminigrid_loop(xminigrid_env)
    )


def test_xminigrid_mutation_fails(xminigrid_env):
    """Control: an adapter that calls every end a time limit."""
    wrong = mutant(
        xminigrid_env, is_truncated=lambda self, timestep, params: timestep.last()
    )
    with pytest.raises(AssertionError):
        assert_same(
            adapter_loop(wrong, jax.random.key(0)), xminigrid_loop(xminigrid_env)
        )


# POPGym Arcade: CountRecallEasy ends when the cards run out or at its move limit; CartPoleEasy
# when the pole falls or at its step limit, which its info counts in "terminated" too
ARCADE = ["CountRecallEasy", "CartPoleEasy"]


@pytest.fixture(scope="module", params=ARCADE)
def arcade_env(request):
    pytest.importorskip("popgym_arcade")
    env = suites.popgym_arcade(f"{request.param}-partial-32")
    env.env.max_steps_in_episode = 30  # its limit is an attribute the step reads
    env.env.num_cards = 8  # CountRecall's: the episode ends after 8 cards
    return env


def arcade_loop(env):
    raw, params = env.env, env.params

    def pixels(obs):  # 4x4 mean pooling of its 128x128 frame, scaled to [0, 1]
        return obs.astype(jnp.float32).reshape(32, 4, 32, 4, 3).mean(axis=(1, 3)) / 255

    def reset(key):
        obs, state = raw.reset_env(key, params)
        return pixels(obs), state

    def step(key, state, action):
        obs, state, reward, done, info = raw.step_env(key, state, action, params)
        truncated = done & info["truncated"]
        return (
            pixels(obs),
            state,
            reward,
            done & info["terminated"] & ~truncated,
            truncated,
        )

    return suite_loop(reset, step, env, jax.random.key(1))


def test_popgym_arcade_steps_as_its_own_loop(arcade_env):
    assert_same(adapter_loop(arcade_env, jax.random.key(1)), arcade_loop(arcade_env))


def every_end_terminates(self, key, tracked, action, params):
    obs, tracked, reward, terminated, info = suites.POPGymArcade.step_env(
        self, key, tracked, action, params
    )
    ended = terminated | tracked.truncated
    return obs, tracked.replace(truncated=jnp.asarray(False)), reward, ended, info


def test_popgym_arcade_mutation_fails(arcade_env):
    """Control: an adapter that takes the game's every end for a termination."""
    wrong = mutant(arcade_env, step_env=every_end_terminates)
    with pytest.raises(AssertionError):
        assert_same(adapter_loop(wrong, jax.random.key(1)), arcade_loop(arcade_env))


def test_popgym_arcade_names():
    pytest.importorskip("popgym_arcade")
    full = suites.popgym_arcade("CountRecallEasy")
    assert not full.env.partial_obs and full.size == 128
    assert suites.popgym_arcade("CountRecallEasy-partial").env.partial_obs
    with pytest.raises(AttributeError, match="GAME\\[-partial\\]\\[-SIZE\\]"):
        suites.popgym_arcade("CountRecallEasy-hidden")
    with pytest.raises(ValueError, match="-48 must divide 128"):
        suites.popgym_arcade("CountRecallEasy-48")


# MuJoCo Playground: CartpoleBalance with a 20-step episode, its step made to terminate once the
# cart leaves [-0.05, 0.05] (its own balance task ends only at the time limit)
EPISODE = 20


@pytest.fixture(scope="module")
def playground_env():
    pytest.importorskip("mujoco_playground")
    env = suites.Playground("CartpoleBalance", episode_length=EPISODE)
    step = env.env.step

    def step_that_terminates(state, action):
        state = step(state, action)
        return state.replace(
            done=(jnp.abs(state.data.qpos[0]) > 0.05).astype(jnp.float32)
        )

    env.env.step = step_that_terminates
    return env


def playground_loop(env):
    raw = env.env

    def reset(key):
        state = raw.reset(key)
        return state.obs, (state, jnp.asarray(0))

    def step(key, state_time, action):
        state, time = state_time
        state = raw.step(state, action)
        # brax's EpisodeWrapper: cut at the episode length unless the step ended it
        terminated = state.done > 0
        return (
            state.obs,
            (state, time + 1),
            state.reward,
            terminated,
            (time + 1 >= EPISODE) & ~terminated,
        )

    return suite_loop(reset, step, env, jax.random.key(2))


def test_playground_steps_as_its_own_loop(playground_env):
    assert_same(
        adapter_loop(playground_env, jax.random.key(2)), playground_loop(playground_env)
    )


def test_playground_mutation_fails(playground_env):
    """Control: an adapter whose time limit comes a step late."""
    wrong = mutant(
        playground_env,
        is_truncated=lambda self, tracked, params: (
            tracked.time > params.max_steps_in_episode
        ),
    )
    with pytest.raises(AssertionError):
        assert_same(
            adapter_loop(wrong, jax.random.key(2)), playground_loop(playground_env)
        )


# Names and installs are refused in one line (the README's commands train each suite through a
# script's `main`: tests/test_readme.py)
TINY = dict(
    num_envs=2, num_steps=8, num_minibatches=2, update_epochs=1, total_timesteps=32
)


@pytest.mark.parametrize(
    "env_id, message",
    [
        ("suites:minigrid/MemoryS8", "suites has no minigrid/MemoryS8"),
        ("suites:xminigrid", "suites has no xminigrid"),
    ],
)
def test_a_wrong_suite_name_is_refused_in_one_line(env_id, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ppo_nnx.main(ppo_nnx.Args(env_id=env_id, **TINY))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err


def test_a_missing_suite_says_how_to_install_it(monkeypatch, capsys):
    real_import = suites.importlib.import_module

    def without_xminigrid(name):
        if name == "xminigrid":
            raise ModuleNotFoundError("No module named 'xminigrid'")
        return real_import(name)

    monkeypatch.setattr(suites.importlib, "import_module", without_xminigrid)
    with pytest.raises(SystemExit):
        ppo_nnx.main(ppo_nnx.Args(env_id="suites:xminigrid/MiniGrid-MemoryS8", **TINY))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and suites.INSTALL in err[0], err


# gymnax's files: POPGym Arcade's declared dependency, stable-gymnax, writes over them
def test_gymnax_files_are_checked_against_their_install(tmp_path, monkeypatch):
    assert (
        suites.gymnax_files_changed() == []
    )  # this install's, in CI with the suites too
    package = tmp_path / "fake"
    package.mkdir()
    (package / "env.py").write_text("step = 6\n")
    record = tmp_path / "fake-1.0.dist-info"
    record.mkdir()
    (record / "METADATA").write_text("Name: fake\nVersion: 1.0\n")
    digest = base64.urlsafe_b64encode(hashlib.sha256(b"step = 6\n").digest()).rstrip(
        b"="
    )
    (record / "RECORD").write_text(f"fake/env.py,sha256={digest.decode()},9\n")
    distribution = importlib.metadata.PathDistribution(record)
    monkeypatch.setattr(
        suites.importlib.metadata, "distribution", lambda name: distribution
    )
    assert suites.gymnax_files_changed() == []
    (package / "env.py").write_text("step = 5\n")  # control: a file written over
    assert suites.gymnax_files_changed() == ["fake/env.py"]
