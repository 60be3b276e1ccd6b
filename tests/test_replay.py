"""Loss replay reproduces the rollout, and the checks fail when replay is broken.

A tiny rollout is recorded with the real `rollout`, then replayed with the real `replay` over
shuffled minibatches of several sizes; every output the rollout produced must come back within
1e-6 at every (step, env).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ppo_nnx as P

TOL = 1e-6
NUM_ENVS, NUM_STEPS = 4, 48
MINIBATCH_COUNTS = (1, 2, NUM_ENVS)
# Short time limits so that one rollout holds several episode ends of both kinds.
MAX_STEPS = {"CartPole-v1": 25, "Pendulum-v1": 20}


def second_rollout(script, args, env, env_params, key):
    """Roll out twice with `script`'s own functions, so the second starts from a used carry:
    (graphdef, params, rest, [T, B] transitions of the second rollout)."""
    init_key, reset_key, runner_key = jax.random.split(key, 3)
    model = script.build_model(args, env, env_params, nnx.Rngs(init_key))
    carry = model.initialize_state(args.num_envs)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(reset_key, args.num_envs), env_params)
    runner = script.Runner(env_state, script.flatten_obs(obs), carry, jnp.zeros(args.num_envs),
                           jnp.zeros(args.num_envs, jnp.int32), runner_key)
    rest, runner, _ = script.rollout(graphdef, params, rest, env, env_params, runner,
                                     args.num_steps)
    rest, _, t = script.rollout(graphdef, params, rest, env, env_params, runner, args.num_steps)
    return graphdef, params, rest, t


def record_and_replay(env_id: str, latent_size: int):
    """Roll out twice (so the carry is not fresh), then replay the second rollout."""
    args = P.Args(env_id=env_id, num_envs=NUM_ENVS, num_steps=NUM_STEPS, hidden_size=16,
                  latent_size=latent_size)
    env, env_params = P.make_env(env_id)
    env_params = env_params.replace(max_steps_in_episode=MAX_STEPS[env_id])

    @jax.jit
    def run(key):
        rollout_key, shuffle_key = jax.random.split(key)
        graphdef, params, rest, t = second_rollout(P, args, env, env_params, rollout_key)
        flat = P.flatten_steps(t)
        batch = P.rollout_batch(t, t.reward, t.reward)  # as the training loop builds it
        replayed = {}
        for count in MINIBATCH_COUNTS:
            permutation = P.epoch_permutations(shuffle_key, NUM_ENVS * NUM_STEPS, 1)[0]
            minibatches = P.split_minibatches(batch, permutation, count)
            order = permutation.reshape(count, -1)

            def step(rest, minibatch):
                out, rest = P.replay(graphdef, params, rest, minibatch)
                return rest, out.output

            _, outputs = jax.lax.scan(step, rest, minibatches)
            # undo the shuffle: scatter each replayed sample back to its (step, env) slot
            replayed[count] = jax.tree.map(
                lambda x: jnp.zeros_like(x.reshape((-1,) + x.shape[2:])).at[order.reshape(-1)]
                .set(x.reshape((-1,) + x.shape[2:])), outputs)
        return t, flat.output, replayed

    return run(jax.random.key(0))


def max_mismatch(rollout_output: dict, replayed_output: dict) -> dict:
    return {k: float(jnp.max(jnp.abs(jnp.asarray(rollout_output[k], jnp.float32)
                                     - jnp.asarray(replayed_output[k], jnp.float32))))
            for k in rollout_output}


CASES = [(env_id, latent) for env_id in ("CartPole-v1", "Pendulum-v1") for latent in (0, 8)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{e}-latent{l}" for e, l in CASES])
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
    expected_keys = {"action", "log_prob", "entropy", "value"} | ({"latent"} if latent else set())
    assert set(rollout_output) == expected_keys
    mismatch = max_mismatch(rollout_output, replayed[count])
    assert all(m <= TOL for m in mismatch.values()), mismatch


def test_negative_control_misrouted_samples(recorded):
    """The same check fails if replayed samples land one (step, env) slot off."""
    _, (_, rollout_output, replayed) = recorded
    shifted = {k: jnp.roll(v, 1, axis=0) for k, v in replayed[2].items()}
    mismatch = max_mismatch(rollout_output, shifted)
    assert mismatch["log_prob"] > TOL and mismatch["value"] > TOL, mismatch


def test_final_observation_is_the_pre_reset_one(recorded):
    """Bootstrapping needs the observation the step led to, not the next episode's first one."""
    _, (t, _, _) = recorded
    done = np.asarray(t.terminated | t.truncated)[:-1]
    same = np.all(np.isclose(np.asarray(t.final_obs)[:-1], np.asarray(t.obs)[1:]), axis=-1)
    assert same[~done].all()
    assert not same[done].any()


def module_rng_bottleneck(script):
    """The bug the per-env key carry exists to prevent: eps from the module-level nnx.Rngs."""

    class ModuleRngBottleneck(script.VariationalBottleneck):
        def __call__(self, key, x, rollout_extras=None):
            mean = self.mean(x)
            std = jax.nn.softplus(self.pre_std(x)) + 1e-6
            eps = jax.random.normal(self.rngs(), mean.shape)
            kl = 0.5 * jnp.sum(mean**2 + std**2 - 1.0 - 2.0 * jnp.log(std), axis=-1)
            return script.Output(key, mean + std * eps, self.kl_coef * kl,
                                 {"losses/kl": kl.mean()}, ())

    return ModuleRngBottleneck


ModuleRngBottleneck = module_rng_bottleneck(P)


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_negative_control_module_rng_breaks_replay(monkeypatch, env_id):
    """The same check must fail for a bottleneck that draws from a module-level RNG."""
    monkeypatch.setattr(P, "VariationalBottleneck", ModuleRngBottleneck)
    _, rollout_output, replayed = record_and_replay(env_id, latent_size=8)
    for count in MINIBATCH_COUNTS:
        mismatch = max_mismatch(rollout_output, replayed[count])
        assert mismatch["latent"] > 1e-2 and mismatch["log_prob"] > TOL, (count, mismatch)


class ResamplingSampler(P.CategoricalSampler):
    """A sampler that draws a fresh action in replay instead of re-scoring the stored one."""

    def __call__(self, key, logits, rollout_extras=None):
        return super().__call__(key, logits, None)


def replays_taken_action(sampler_class) -> bool:
    """After a parameter change, replay must score the action taken, not a new sample."""
    sampler = sampler_class(nnx.Rngs(0))
    keys = sampler.initialize_state(1000)
    before = jnp.tile(jnp.array([[2.0, 0.0]]), (1000, 1))  # mostly action 0 ...
    after = before[:, ::-1]  # ... and, after an "update", mostly action 1
    rollout = sampler(keys, before)
    replayed = sampler(keys, after, rollout.rollout_extras)
    expected = jax.nn.log_softmax(after)[jnp.arange(1000), rollout.output["action"]]
    return bool(jnp.all(replayed.output["action"] == rollout.output["action"])
                and jnp.allclose(replayed.output["log_prob"], expected, atol=TOL))


def test_replay_scores_the_taken_action_after_an_update():
    assert replays_taken_action(P.CategoricalSampler)


def test_negative_control_resampling_sampler():
    assert not replays_taken_action(ResamplingSampler)
