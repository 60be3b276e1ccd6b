"""ppo_nnx_vae_lstm.py: replaying whole sequences from the stored start carry gives back every
output, LSTM state and key of the rollout, at every (step, env).

A rollout (the second of two, so its start carry is a live one) is recorded with the real
`rollout`, then replayed with the real `replay` over minibatches of whole env sequences. A replay
from a zero LSTM state, one that skips the resets, and a bottleneck with a module-level RNG must
fail the same check.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ppo_nnx_vae_lstm as recurrent
from conftest import TOL, module_rng_bottleneck, rounding, second_rollout, tiny_args

NUM_ENVS, NUM_STEPS = 4, 48
MINIBATCH_COUNTS = (1, 2, NUM_ENVS)
# several episode ends of both kinds
MAX_STEPS = {"CartPole-v1": 30, "Pendulum-v1": 20, "Breakout-MinAtar": 20}
ENCODER = {"Breakout-MinAtar": "conv"}  # images [10, 10, 4]: through the CNN


def record_and_replay(env_id: str, latent_size: int = 8):
    """(transitions, {count: replayed Output}, {bug: replayed Output}, (bootstrap, blank one))."""
    norm = env_id == "Pendulum-v1"  # continuous control: normalized, as by default
    args = tiny_args(
        recurrent,
        env_id=env_id,
        num_steps=NUM_STEPS,
        latent_size=latent_size,
        norm_obs=norm,
        norm_reward=norm,
        encoder=ENCODER.get(env_id, "mlp"),
    )
    env, env_params = recurrent.make_env(args)
    env_params = env_params.replace(max_steps_in_episode=MAX_STEPS[env_id])

    @jax.jit
    def record(key):
        rollout_key, shuffle_key = jax.random.split(key)
        graphdef, params, rest, t = second_rollout(
            recurrent, args, env, env_params, rollout_key
        )
        batch = recurrent.rollout_batch(
            t, t.reward, t.reward
        )  # as the training loop builds it
        permutation = jax.random.permutation(shuffle_key, NUM_ENVS)

        def replay_by_env(batch, count):
            """Replay in `count` minibatches of whole sequences; results back in env order."""
            minibatches = recurrent.split_minibatches(batch, permutation, count)
            out = jax.lax.map(
                lambda b: recurrent.replay(graphdef, params, rest, b), minibatches
            )
            # [count, T, envs per minibatch, ...] -> [T, B, ...], then undo the shuffle
            return jax.tree.map(
                lambda x: jnp.moveaxis(x, 0, 1).reshape(
                    (NUM_STEPS, NUM_ENVS) + x.shape[3:]
                )[:, jnp.argsort(permutation)],
                out._replace(metrics={}),
            )

        lstm = batch.carry["lstm"]
        broken = {
            "zero carry": batch._replace(
                carry={**batch.carry, "lstm": jax.tree.map(jnp.zeros_like, lstm)}
            ),
            "skipped reset": batch._replace(done=jnp.zeros_like(batch.done)),
        }
        model = nnx.merge(graphdef, params, rest)
        blank = jax.tree.map(jnp.zeros_like, t.next_carry["lstm"])
        return (
            t,
            {count: replay_by_env(batch, count) for count in MINIBATCH_COUNTS},
            {bug: replay_by_env(b, 2) for bug, b in broken.items()},
            (
                recurrent.bootstrap_values(model, t),
                recurrent.bootstrap_values(
                    model, t._replace(next_carry={**t.next_carry, "lstm": blank})
                ),
            ),
        )

    return record(jax.random.key(0))


def largest_difference(t, replayed) -> dict:
    """Per output, and per leaf of the carry each step returned (keys: 1 where they differ)."""
    found = {
        k: rounding(jnp.asarray(t.output[k], jnp.float32), jnp.asarray(v, jnp.float32))
        for k, v in replayed.output.items()
    }
    for name in t.next_carry:
        pairs = zip(
            jax.tree.leaves(t.next_carry[name]),
            jax.tree.leaves(replayed.next_state[name]),
        )
        for i, (a, b) in enumerate(pairs):
            if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
                a, b = jax.random.key_data(a), jax.random.key_data(b)
                found[f"carry/{name}/{i}"] = (a != b).astype(jnp.float32)
            else:
                found[f"carry/{name}/{i}"] = rounding(a, b)
    return {k: float(v.max()) for k, v in found.items()}


CASES = [
    ("CartPole-v1", 8),
    ("Pendulum-v1", 8),
    ("CartPole-v1", 0),
    ("Breakout-MinAtar", 8),
]


@pytest.fixture(
    scope="module", params=CASES, ids=[f"{env}-latent{latent}" for env, latent in CASES]
)
def recorded(request):
    return record_and_replay(*request.param)


def test_rollout_has_episode_ends_and_a_live_start_carry(recorded):
    t, *_ = recorded
    ends = np.asarray(t.terminated | t.truncated).sum(axis=0)
    assert (ends >= 1).all() and ends.sum() >= 2 * NUM_ENVS, ends
    start_hidden = np.asarray(t.carry["lstm"][1][0])
    assert (
        np.abs(start_hidden).min(axis=-1).max() > 0
        and np.abs(start_hidden).max() > 1e-2
    )


@pytest.mark.parametrize("count", MINIBATCH_COUNTS)
def test_replay_reproduces_rollout(recorded, count):
    t, replayed, _, _ = recorded
    assert set(replayed[count].output) == {
        "action",
        "log_prob",
        "entropy",
        "value",
        "mode",
    } | ({"latent"} if "bottleneck" in t.carry else set())
    assert set(replayed[count].next_state) == set(t.carry) >= {"lstm", "sampler"}
    difference = largest_difference(t, replayed[count])
    assert all(d <= TOL for d in difference.values()), difference


@pytest.mark.parametrize("bug", ["zero carry", "skipped reset"])
def test_negative_control_broken_replay_fails(recorded, bug):
    """The same check fails for a replay from a zero LSTM state, and for one that never resets."""
    t, _, broken, _ = recorded
    difference = largest_difference(t, broken[bug])
    for key in ("log_prob", "value", "carry/lstm/0", "carry/lstm/1") + (
        ("latent",) if "bottleneck" in t.carry else ()
    ):
        assert difference[key] > TOL, (key, difference)


def test_reset_restores_the_initial_state_of_that_env_only(recorded):
    """After an episode end that env's LSTM state is the initial one; the others run on."""
    t, *_ = recorded
    done = np.asarray(t.terminated | t.truncated)[
        :-1
    ]  # ended at step t, so reset before t + 1
    initial = recurrent.LSTM(16, 16, nnx.Rngs(0)).initialize_state(NUM_ENVS)
    for called, returned, first in zip(
        jax.tree.leaves(t.carry["lstm"]), jax.tree.leaves(t.next_carry["lstm"]), initial
    ):
        called, returned = np.asarray(called)[1:], np.asarray(returned)[:-1]
        assert np.all(called[done] == np.asarray(first)[0])
        np.testing.assert_array_equal(called[~done], returned[~done])
        assert (
            np.abs(returned[done]).max() > 1e-2
        )  # so the reset really changed something
    for name in set(t.carry) - {"lstm"}:  # the keys run on through resets
        np.testing.assert_array_equal(
            jax.random.key_data(t.carry[name][1:]),
            jax.random.key_data(t.next_carry[name][:-1]),
        )


def test_bootstrap_value_continues_the_carry(recorded):
    """V(final obs) from the step's carry is the next step's value wherever no reset came between.
    Negative control: the same value from a blank LSTM state does not pass."""
    t, _, _, (bootstrap, blank) = recorded
    done = np.asarray(t.terminated | t.truncated)[:-1]
    next_value = np.asarray(t.output["value"])[1:]
    assert np.abs(np.asarray(bootstrap)[:-1][~done] - next_value[~done]).max() <= TOL
    assert np.abs(np.asarray(blank)[:-1][~done] - next_value[~done]).max() > TOL


def test_negative_control_module_rng_breaks_replay(monkeypatch):
    """The same check fails for a bottleneck that draws from its module-level nnx.Rngs."""
    monkeypatch.setattr(
        recurrent, "VariationalBottleneck", module_rng_bottleneck(recurrent)
    )
    t, replayed, _, _ = record_and_replay("CartPole-v1")
    for count in MINIBATCH_COUNTS:
        difference = largest_difference(t, replayed[count])
        assert difference["latent"] > 1e-2 and difference["log_prob"] > TOL, (
            count,
            difference,
        )


def test_unroll_overrides_match_stepping_the_call():
    """LSTM and KeyCarryModule batch what they can in `unroll`; the protocol's default `unroll`
    steps `__call__` through time. Both must give the same, resets included."""
    T, B = 6, 4
    xs = jax.random.normal(jax.random.key(2), (T, B, 3))
    done = jnp.zeros((T, B), bool).at[2, 1].set(True).at[4, 0].set(True)
    lstm = recurrent.LSTM(3, 5, nnx.Rngs(0))
    bottleneck = recurrent.VariationalBottleneck(3, 2, 1.0, nnx.Rngs(1))
    live = (jnp.full((B, 5), 0.5), jnp.full((B, 5), -0.3))
    for module, carry in ((lstm, live), (bottleneck, bottleneck.initialize_state(B))):
        fast = module.unroll(carry, xs, done)
        slow = recurrent.StatefulModule.unroll(module, carry, xs, done)
        np.testing.assert_allclose(fast.output, slow.output, atol=TOL)
        np.testing.assert_allclose(
            fast.regularization_loss, slow.regularization_loss, atol=1e-5
        )
        for a, b in zip(
            jax.tree.leaves(fast.next_state), jax.tree.leaves(slow.next_state)
        ):
            if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
                a, b = jax.random.key_data(a), jax.random.key_data(b)
            np.testing.assert_allclose(a, b, atol=TOL)
    # negative control: without the resets the LSTM's outputs differ after the first one
    slow = recurrent.StatefulModule.unroll(lstm, live, xs, jnp.zeros_like(done))
    assert (
        np.abs(np.asarray(lstm.unroll(live, xs, done).output - slow.output)).max()
        > 1e-3
    )
