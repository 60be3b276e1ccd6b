"""ppo_nnx.py: loss replay gives back every rollout output, at every (step, env).

A rollout (the second of two, so the carry is not fresh) is recorded with the real `rollout`,
then replayed with the real `replay` over shuffled minibatches of three sizes. Replays that are
broken on purpose must fail the same check.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ppo_nnx
from conftest import TOL, module_rng_bottleneck, rounding, second_rollout, tiny_args

NUM_ENVS, NUM_STEPS = 4, 48
MINIBATCH_COUNTS = (1, 2, NUM_ENVS)
# several episode ends of both kinds
MAX_STEPS = {"CartPole-v1": 25, "Pendulum-v1": 20, "Breakout-MinAtar": 20}
ENCODER = {"Breakout-MinAtar": "conv"}  # images [10, 10, 4]: through the CNN


def record_and_replay(env_id: str, latent_size: int):
    """(transitions, the rollout's outputs [T * B], {minibatch count: replayed outputs})."""
    norm = env_id == "Pendulum-v1"  # continuous control: normalized, as by default
    args = tiny_args(
        ppo_nnx,
        env_id=env_id,
        num_steps=NUM_STEPS,
        latent_size=latent_size,
        norm_obs=norm,
        norm_reward=norm,
        encoder=ENCODER.get(env_id, "mlp"),
    )
    env, env_params = ppo_nnx.make_env(args)
    env_params = env_params.replace(max_steps_in_episode=MAX_STEPS[env_id])

    @jax.jit
    def record(key):
        rollout_key, shuffle_key = jax.random.split(key)
        graphdef, params, rest, t = second_rollout(
            ppo_nnx, args, env, env_params, rollout_key
        )
        batch = ppo_nnx.rollout_batch(
            t, t.reward, t.reward
        )  # as the training loop builds it
        permutation = jax.random.permutation(shuffle_key, NUM_ENVS * NUM_STEPS)
        replayed = {}
        for count in MINIBATCH_COUNTS:
            minibatches = ppo_nnx.split_minibatches(batch, permutation, count)
            outputs = jax.lax.map(
                lambda b: ppo_nnx.replay(graphdef, params, rest, b).output, minibatches
            )
            # undo the shuffle: each replayed sample back to its (step, env) slot
            replayed[count] = jax.tree.map(
                lambda x: (
                    jnp.zeros_like(x.reshape((-1,) + x.shape[2:]))
                    .at[permutation]
                    .set(x.reshape((-1,) + x.shape[2:]))
                ),
                outputs,
            )
        return t, ppo_nnx.flatten_steps(t.output), replayed

    return record(jax.random.key(0))


def largest_difference(rollout_output: dict, replayed_output: dict) -> dict:
    return {
        k: float(
            jnp.max(
                rounding(
                    jnp.asarray(rollout_output[k], jnp.float32),
                    jnp.asarray(replayed_output[k], jnp.float32),
                )
            )
        )
        for k in rollout_output
    }


CASES = [
    (env_id, latent) for env_id in ("CartPole-v1", "Pendulum-v1") for latent in (0, 8)
] + [("Breakout-MinAtar", 8)]


@pytest.fixture(
    scope="module", params=CASES, ids=[f"{env}-latent{latent}" for env, latent in CASES]
)
def recorded(request):
    return request.param, record_and_replay(*request.param)


def test_rollout_has_several_episode_ends(recorded):
    (env_id, _), (t, _, _) = recorded
    ends = np.asarray(t.terminated | t.truncated).sum(axis=0)
    assert (ends >= 1).all() and ends.sum() >= 2 * NUM_ENVS, ends
    if env_id == "Pendulum-v1":  # Pendulum only ever truncates
        assert np.asarray(t.truncated).sum() >= 2 * NUM_ENVS


@pytest.mark.parametrize("count", MINIBATCH_COUNTS)
def test_replay_reproduces_rollout(recorded, count):
    (_, latent), (_, rollout_output, replayed) = recorded
    assert set(rollout_output) == {"action", "log_prob", "entropy", "value", "mode"} | (
        {"latent"} if latent else set()
    )
    difference = largest_difference(rollout_output, replayed[count])
    assert all(d <= TOL for d in difference.values()), difference


def test_negative_control_misrouted_samples(recorded):
    """The same check fails if replayed samples land one (step, env) slot off."""
    _, (_, rollout_output, replayed) = recorded
    shifted = {k: jnp.roll(v, 1, axis=0) for k, v in replayed[2].items()}
    difference = largest_difference(rollout_output, shifted)
    assert difference["log_prob"] > TOL and difference["value"] > TOL, difference


def test_final_observation_is_the_pre_reset_one(recorded):
    """Bootstrapping needs the observation the step led to, not the next episode's first one."""
    _, (t, _, _) = recorded
    done = np.asarray(t.terminated | t.truncated)[:-1]
    close = np.isclose(np.asarray(t.final_obs)[:-1], np.asarray(t.obs)[1:])
    same = close.reshape(done.shape + (-1,)).all(-1)  # every feature (or pixel)
    assert same[~done].all()
    assert not same[done].any()


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_negative_control_module_rng_breaks_replay(monkeypatch, env_id):
    """The same check fails for a bottleneck that draws from its module-level nnx.Rngs."""
    monkeypatch.setattr(
        ppo_nnx, "VariationalBottleneck", module_rng_bottleneck(ppo_nnx)
    )
    _, rollout_output, replayed = record_and_replay(env_id, latent_size=8)
    for count in MINIBATCH_COUNTS:
        difference = largest_difference(rollout_output, replayed[count])
        assert difference["latent"] > 1e-2 and difference["log_prob"] > TOL, (
            count,
            difference,
        )


class ResamplingSampler(ppo_nnx.CategoricalSampler):
    """A sampler that draws a fresh action in replay instead of re-scoring the stored one."""

    def __call__(self, key, logits, rollout_extras=None):
        return super().__call__(key, logits, None)


def scores_the_taken_action(sampler_class) -> bool:
    """After a parameter change, replay must score the action taken, not a new sample."""
    sampler = sampler_class(nnx.Rngs(0))
    keys = sampler.initialize_state(1000)
    before = jnp.tile(jnp.array([[2.0, 0.0]]), (1000, 1))  # mostly action 0 ...
    after = before[:, ::-1]  # ... and, after an "update", mostly action 1
    rollout = sampler(keys, before)
    replayed = sampler(keys, after, rollout.rollout_extras)
    expected = jax.nn.log_softmax(after)[jnp.arange(1000), rollout.output["action"]]
    return bool(
        jnp.all(replayed.output["action"] == rollout.output["action"])
        and jnp.allclose(replayed.output["log_prob"], expected, atol=TOL)
    )


def test_replay_scores_the_taken_action_after_an_update():
    assert scores_the_taken_action(ppo_nnx.CategoricalSampler)


def test_negative_control_resampling_sampler():
    assert not scores_the_taken_action(ResamplingSampler)
