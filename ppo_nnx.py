"""PPO for gymnax environments with a Flax NNX actor-critic, in one file, with exact loss replay.

    python ppo_nnx.py --env-id CartPole-v1

Every PPO iteration runs the network twice: a *rollout* pass that acts in the environment and a
*loss replay* pass that recomputes the same outputs on the recorded data so the clipped objective
can be differentiated. PPO's ratio compares the two, so before the first gradient step the replay
must give back exactly what the rollout saw. That holds here even for stochastic layers, because
every random draw comes from a per-env key kept in the network's carry (stored with the data and
sliced with it), and every sampled action is kept in `rollout_extras` and re-scored, never
re-sampled. The file reads top to bottom in the order the data flows: arguments, modules,
environment, rollout, advantages, loss replay, update, training loop, main.
"""

import dataclasses
import math
import os
import sys
import time
from typing import Any, NamedTuple, Optional

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from flax import nnx


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment; with --num-seeds N, seeds seed .. seed+N-1 train at once"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases"""
    wandb_project_name: str = "ppo-nnx"
    """the wandb's project name"""
    wandb_entity: Optional[str] = None
    """the entity (team) of wandb's project"""

    env_id: str = "CartPole-v1"
    """the id of the gymnax environment"""
    mask_velocity: bool = False
    """hide the velocities from the observation (CartPole-v1, Pendulum-v1): a task needing memory"""
    total_timesteps: int = 500_000
    """total env steps of the experiment (per seed)"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer"""
    num_envs: int = 4
    """the number of parallel game environments"""
    num_steps: int = 128
    """the number of steps to run in each environment per policy rollout"""
    anneal_lr: bool = True
    """toggle learning rate annealing for policy and value networks"""
    gamma: float = 0.99
    """the discount factor gamma"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation"""
    num_minibatches: int = 4
    """the number of mini-batches"""
    update_epochs: int = 4
    """the K epochs to update the policy"""
    norm_adv: bool = True
    """toggles advantages normalization"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function"""
    ent_coef: float = 0.01
    """coefficient of the entropy"""
    vf_coef: float = 0.5
    """coefficient of the value function"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping"""

    num_seeds: int = 1
    """seeds trained at once by jax.vmap, in one compiled program"""
    hidden_size: int = 64
    """width of the two tanh hidden layers of the actor and of the critic"""
    latent_size: int = 0
    """size of the VariationalBottleneck in the actor (0 = no bottleneck)"""
    kl_coef: float = 1e-3
    """weight of the bottleneck's KL to N(0, I) in the loss"""

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.num_minibatches

    @property
    def num_iterations(self) -> int:
        return self.total_timesteps // self.batch_size


def check_args(args: Args) -> None:
    """Reject bad settings with a message naming the flag, before anything is compiled."""
    for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs",
                 "num_seeds", "hidden_size"):
        value = getattr(args, name)
        if value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.latent_size < 0:
        raise ValueError(
            f"--latent-size must be 0 (no bottleneck) or positive, got {args.latent_size}")
    for name in ("gamma", "gae_lambda"):
        value = getattr(args, name)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {value}")
    for name in ("learning_rate", "clip_coef", "ent_coef", "vf_coef", "max_grad_norm", "kl_coef"):
        value = getattr(args, name)
        if not value >= 0.0:  # also catches NaN
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.batch_size % args.num_minibatches:
        raise ValueError(
            f"--num-minibatches {args.num_minibatches} must divide the batch "
            f"--num-envs * --num-steps = {args.num_envs} * {args.num_steps} = {args.batch_size}")
    if args.total_timesteps < args.batch_size:
        raise ValueError(
            f"--total-timesteps {args.total_timesteps} is below one batch "
            f"(--num-envs * --num-steps = {args.batch_size}); use at least {args.batch_size}")


# ----------------------------------------------------------------------------------------------
# Modules: the stateful-module protocol, the layers, the actor-critic
# ----------------------------------------------------------------------------------------------
class Output(NamedTuple):
    next_state: Any  # the carry for the next step, leading axis [B]
    output: Any  # what the caller consumes
    regularization_loss: jax.Array  # [B], added to the PPO loss
    metrics: dict  # scalars worth logging
    rollout_extras: Any  # what loss replay needs to reproduce this call


class StatefulModule(nnx.Module):
    """A module whose per-env state travels in an explicit carry instead of NNX variables.

    `__call__(carry, x, rollout_extras=None)`: with `rollout_extras=None` (rollout, inference) the
    module samples fresh and emits what replay needs; given the stored `rollout_extras` (loss
    replay) it consumes them instead. Write rule: `__call__` never writes an NNX variable that
    affects its output, so replay sees the parameters the rollout saw, whatever ran in between.
    """

    def initialize_state(self, batch_size: int) -> Any:
        return ()

    def reset_state(self, carry: Any) -> Any:
        """The carry for an env whose episode just ended (the caller selects those envs)."""
        return carry

    def __call__(self, carry: Any, x: jax.Array, rollout_extras: Any = None) -> Output:
        raise NotImplementedError


def where_done(done: jax.Array, reset: Any, keep: Any) -> Any:
    """Per env, `reset` where the episode ended and `keep` elsewhere."""
    return jax.tree.map(
        lambda r, k: jnp.where(done.reshape(done.shape + (1,) * (k.ndim - 1)), r, k), reset, keep)


def flatten_steps(tree):
    """[T, B, ...] -> [T * B, ...]."""
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tree)


def split_per_env(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Advance each env's key on its own: (next keys, keys to draw from), both [B]."""
    both = jax.vmap(jax.random.split)(keys)
    return both[:, 0], both[:, 1]


def normal_per_env(keys: jax.Array, like: jax.Array) -> jax.Array:
    """Standard normal noise shaped like `like` ([B, ...]), row b drawn from keys[b] alone."""
    return jax.vmap(lambda key: jax.random.normal(key, like.shape[1:]))(keys)


class KeyCarryModule(StatefulModule):
    """A stochastic module whose carry is one PRNG key per env, shape [B].

    The key is split locally on every call. It is stored with the rollout and sliced with the
    observations, so a replay minibatch of any size draws exactly what the rollout drew.
    `self.rngs` is read only by `initialize_state`: a module-level RNG advanced in `__call__`
    would start replay from the post-rollout state, and would hand out different subkeys to
    batches of different sizes. `reset_state` keeps the key chain running through episode ends:
    a fixed key at every reset would repeat the same noise in every episode.
    """

    def __init__(self, rngs: nnx.Rngs):
        self.rngs = rngs

    def initialize_state(self, batch_size: int) -> jax.Array:
        return jax.random.split(self.rngs(), batch_size)


class MLP(nnx.Module):
    """Dense layers with tanh between them (the last is linear), CleanRL's orthogonal init."""

    def __init__(self, sizes: list[int], out_scale: float, rngs: nnx.Rngs):
        scales = [math.sqrt(2)] * (len(sizes) - 2) + [out_scale]
        self.layers = nnx.List([
            nnx.Linear(n_in, n_out, kernel_init=nnx.initializers.orthogonal(scale),
                       bias_init=nnx.initializers.zeros_init(), rngs=rngs)
            for n_in, n_out, scale in zip(sizes[:-1], sizes[1:], scales)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jnp.tanh(layer(x))
        return self.layers[-1](x)


class VariationalBottleneck(KeyCarryModule):
    """z = mean + std * eps with the KL to N(0, I) as a loss, eps drawn from the per-env key."""

    def __init__(self, in_size: int, latent_size: int, kl_coef: float, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.mean = nnx.Linear(in_size, latent_size, rngs=rngs)
        self.pre_std = nnx.Linear(in_size, latent_size, rngs=rngs)
        self.kl_coef = kl_coef

    def __call__(self, key, x, rollout_extras=None):
        del rollout_extras  # the stored key reproduces the noise; nothing else is needed
        next_key, noise_key = split_per_env(key)
        mean = self.mean(x)
        std = jax.nn.softplus(self.pre_std(x)) + 1e-6
        eps = normal_per_env(noise_key, mean)
        kl = 0.5 * jnp.sum(mean**2 + std**2 - 1.0 - 2.0 * jnp.log(std), axis=-1)
        return Output(next_key, mean + std * eps, self.kl_coef * kl, {"losses/kl": kl.mean()}, ())


class CategoricalSampler(KeyCarryModule):
    """Samples a discrete action from logits; replay re-scores the stored action."""

    def __call__(self, key, logits, rollout_extras=None):
        next_key, sample_key = split_per_env(key)  # the same chain in replay, where it goes unused
        if rollout_extras is None:
            action = jax.vmap(jax.random.categorical)(sample_key, logits)
        else:
            action = rollout_extras
        log_probs = jax.nn.log_softmax(logits)
        # a one-hot product rather than an index: its gradient avoids a slow scatter on CPU
        log_prob = jnp.sum(jax.nn.one_hot(action, logits.shape[-1]) * log_probs, axis=-1)
        entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
        output = {"action": action, "log_prob": log_prob, "entropy": entropy}
        return Output(next_key, output, jnp.zeros_like(log_prob), {}, action)


class GaussianSampler(KeyCarryModule):
    """Diagonal Gaussian with a state-independent log-std, as in CleanRL's continuous PPO.

    The raw, unbounded sample is what gets stored and scored; the env receives it clipped to the
    action bounds. Scoring the clipped action instead would give it the wrong density.
    """

    def __init__(self, action_dim: int, low: tuple, high: tuple, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.log_std = nnx.Param(jnp.zeros(action_dim))
        self.low, self.high = low, high

    def __call__(self, key, mean, rollout_extras=None):
        next_key, sample_key = split_per_env(key)
        std = jnp.exp(self.log_std[...])
        if rollout_extras is None:
            raw = mean + std * normal_per_env(sample_key, mean)
        else:
            raw = rollout_extras
        log_prob = jnp.sum(-0.5 * ((raw - mean) / std) ** 2 - self.log_std[...]
                           - 0.5 * math.log(2 * math.pi), axis=-1)
        entropy = jnp.broadcast_to(jnp.sum(0.5 + 0.5 * math.log(2 * math.pi) + self.log_std[...]),
                                   log_prob.shape)
        action = jnp.clip(raw, jnp.asarray(self.low), jnp.asarray(self.high))
        output = {"action": action, "log_prob": log_prob, "entropy": entropy}
        return Output(next_key, output, jnp.zeros_like(log_prob), {}, raw)


class ActorCritic(StatefulModule):
    """CleanRL's separate actor and critic MLPs, with an optional bottleneck in the actor.

    A container: its carry and rollout_extras are dicts keyed by its stateful children, and each
    child gets its own entry. The critic is deterministic, so values need no carry.
    """

    def __init__(self, obs_size: int, action_head: int, sampler: StatefulModule, args: Args,
                 rngs: nnx.Rngs):
        h = args.hidden_size
        self.actor_torso = MLP([obs_size, h, h], out_scale=math.sqrt(2), rngs=rngs)
        self.bottleneck = (VariationalBottleneck(h, args.latent_size, args.kl_coef, rngs)
                           if args.latent_size else None)
        head_in = args.latent_size or h
        self.actor_head = nnx.Linear(head_in, action_head, rngs=rngs,
                                     kernel_init=nnx.initializers.orthogonal(0.01),
                                     bias_init=nnx.initializers.zeros_init())
        self.sampler = sampler
        self.critic = MLP([obs_size, h, h, 1], out_scale=1.0, rngs=rngs)

    def stateful_children(self) -> dict[str, StatefulModule]:
        children = {"bottleneck": self.bottleneck, "sampler": self.sampler}
        return {name: child for name, child in children.items() if child is not None}

    def initialize_state(self, batch_size):
        children = self.stateful_children()
        return {name: child.initialize_state(batch_size) for name, child in children.items()}

    def reset_state(self, carry):
        return {name: c.reset_state(carry[name]) for name, c in self.stateful_children().items()}

    def value(self, obs: jax.Array) -> jax.Array:
        return self.critic(obs)[:, 0]

    def __call__(self, carry, obs, rollout_extras=None):
        outs = {}

        def run(name, x):
            extras = None if rollout_extras is None else rollout_extras[name]
            outs[name] = self.stateful_children()[name](carry[name], x, extras)
            return outs[name].output

        hidden = jnp.tanh(self.actor_torso(obs))
        if self.bottleneck is not None:
            hidden = run("bottleneck", hidden)
        output = dict(run("sampler", self.actor_head(hidden)), value=self.value(obs))
        if self.bottleneck is not None:
            output["latent"] = hidden
        return Output(
            next_state={name: out.next_state for name, out in outs.items()},
            output=output,
            regularization_loss=sum(out.regularization_loss for out in outs.values()),
            metrics={k: v for out in outs.values() for k, v in out.metrics.items()},
            rollout_extras={name: out.rollout_extras for name, out in outs.items()},
        )


# ----------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------
POSITIONS = {"CartPole-v1": (0, 2), "Pendulum-v1": (0, 1)}  # the entries --mask-velocity keeps


class MaskVelocity:
    """Shows the agent only positions and angles, so it must infer velocities from memory.

    Wraps a gymnax 1.0 env; the observation after a reset and `final_observation` are masked alike.
    """

    def __init__(self, env, keep: tuple):
        self.env, self.keep = env, np.asarray(keep)

    def reset(self, key, params):
        obs, state = self.env.reset(key, params)
        return obs[..., self.keep], state

    def step(self, key, state, action, params):
        obs, state, reward, terminated, truncated, info = self.env.step(key, state, action, params)
        info = {**info, "final_observation": info["final_observation"][..., self.keep]}
        return obs[..., self.keep], state, reward, terminated, truncated, info

    def observation_space(self, params):
        space = self.env.observation_space(params)
        low, high = (jnp.broadcast_to(b, space.shape)[self.keep]
                     for b in (space.low, space.high))
        return gymnax.environments.spaces.Box(low, high, (len(self.keep),), space.dtype)

    def __getattr__(self, name):  # the rest (action_space, default_params, ...) as the env's
        if name.startswith("__") or name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)


def make_env(env_id: str, mask_velocity: bool = False):
    """gymnax.make with errors that name the flag; returns (env, env_params)."""
    if env_id not in gymnax.registered_envs:
        raise ValueError(f"--env-id {env_id!r} is not a gymnax environment; choose one of: "
                         + ", ".join(gymnax.registered_envs))
    if mask_velocity and env_id not in POSITIONS:
        raise ValueError(f"--mask-velocity supports --env-id {' or '.join(POSITIONS)}, "
                         f"not {env_id}")
    try:
        env, env_params = gymnax.make(env_id)
    except Exception as error:  # e.g. an env that downloads data on this offline machine
        raise ValueError(f"--env-id {env_id}: gymnax could not build it ({error})") from None
    space = env.action_space(env_params)
    if not isinstance(space, (gymnax.environments.spaces.Discrete, gymnax.environments.spaces.Box)):
        raise ValueError(f"--env-id {env_id}: action space {space} is not supported; "
                         "this script handles Discrete and Box action spaces")
    if mask_velocity:
        env = MaskVelocity(env, POSITIONS[env_id])
    return env, env_params


def build_model(args: Args, env, env_params, rngs: nnx.Rngs) -> ActorCritic:
    """The actor-critic for this env; the sampler follows from the action space."""
    obs_size = int(np.prod(env.observation_space(env_params).shape, dtype=int))
    with jax.ensure_compile_time_eval():  # bounds built with jnp (Reacher-misc...) stay concrete
        space = env.action_space(env_params)
    if isinstance(space, gymnax.environments.spaces.Discrete):
        return ActorCritic(obs_size, space.n, CategoricalSampler(rngs), args, rngs)
    shape = (int(np.prod(space.shape, dtype=int)),)
    low = tuple(np.broadcast_to(np.asarray(space.low, np.float32), shape).tolist())
    high = tuple(np.broadcast_to(np.asarray(space.high, np.float32), shape).tolist())
    return ActorCritic(obs_size, shape[0], GaussianSampler(shape[0], low, high, rngs), args, rngs)


def flatten_obs(obs: jax.Array) -> jax.Array:
    """[B, ...] -> [B, features] float32, so MinAtar's grids feed the MLP too."""
    return obs.reshape(obs.shape[0], -1).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# Rollout
# ----------------------------------------------------------------------------------------------
class Runner(NamedTuple):
    """What the rollout carries from one iteration to the next."""
    env_state: Any
    obs: jax.Array  # [B, features]
    carry: Any  # the network carry, [B] leading axis
    episode_return: jax.Array  # [B] running totals of the unfinished episodes
    episode_length: jax.Array
    key: jax.Array


class Transition(NamedTuple):
    """One step of all envs; the rollout stacks them into [T, B, ...]."""
    obs: jax.Array
    carry: Any  # the carry the network was called with: replay calls it with the same
    rollout_extras: Any  # raw sampled actions, keyed like the carry
    output: dict  # the network's outputs: action, log_prob, entropy, value (and latent)
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    final_obs: jax.Array  # the observation the step led to, before any auto-reset
    episode_return: jax.Array  # of the episode that ended at this step, else 0
    episode_length: jax.Array


def non_params(model: nnx.Module):
    """The model's state other than its parameters (its nnx.Rngs), as after the call."""
    return nnx.split(model, nnx.Param, ...)[2]


def rollout(graphdef, params, rest, env, env_params, runner: Runner, num_steps: int):
    """Run the policy for num_steps in every env: returns (rest, runner, [T, B] transitions).

    `rest` is the model's non-parameter state; it is threaded through so that a module which broke
    the write rule would show it, rather than have its writes silently dropped.
    """

    def step(carry, _):
        rest, runner = carry
        model = nnx.merge(graphdef, params, rest)
        out = model(runner.carry, runner.obs)
        key, step_key = jax.random.split(runner.key)
        env_keys = jax.random.split(step_key, runner.obs.shape[0])
        obs, env_state, reward, terminated, truncated, info = jax.vmap(
            env.step, in_axes=(0, 0, 0, None))(env_keys, runner.env_state, out.output["action"],
                                               env_params)
        done = terminated | truncated
        episode_return = runner.episode_return + reward
        episode_length = runner.episode_length + 1
        transition = Transition(
            obs=runner.obs, carry=runner.carry, rollout_extras=out.rollout_extras,
            output=out.output, reward=reward, terminated=terminated, truncated=truncated,
            final_obs=flatten_obs(info["final_observation"]),
            episode_return=jnp.where(done, episode_return, 0.0),
            episode_length=jnp.where(done, episode_length, 0))
        runner = Runner(
            env_state=env_state, obs=flatten_obs(obs),
            carry=where_done(done, model.reset_state(out.next_state), out.next_state),
            episode_return=jnp.where(done, 0.0, episode_return),
            episode_length=jnp.where(done, 0, episode_length), key=key)
        return (non_params(model), runner), transition

    (rest, runner), transitions = jax.lax.scan(step, (rest, runner), length=num_steps)
    return rest, runner, transitions


# ----------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------
def bootstrap_values(model: ActorCritic, t: Transition) -> jax.Array:
    """V(final observation) of every step, [T, B], in one batched pass: no step waits on another."""
    return model.value(flatten_steps(t.final_obs)).reshape(t.reward.shape)


def compute_gae(rewards, values, next_values, terminated, truncated, gamma, gae_lambda):
    """GAE over [T, B]; returns (advantages, returns).

    `next_values` is the value of the observation each step led to (before auto-reset), so a
    time limit bootstraps from where the episode was cut off, while termination ends the return.
    Either way the advantage does not flow back across an episode boundary.
    """

    def backward(next_advantage, t):
        reward, value, next_value, term, trunc = t
        delta = reward + gamma * next_value * (1.0 - term) - value
        advantage = delta + gamma * gae_lambda * (1.0 - (term | trunc)) * next_advantage
        return advantage, advantage

    _, advantages = jax.lax.scan(
        backward, jnp.zeros_like(values[0]),
        (rewards, values, next_values, terminated, truncated), reverse=True)
    return advantages, advantages + values


# ----------------------------------------------------------------------------------------------
# Loss replay
# ----------------------------------------------------------------------------------------------
class Batch(NamedTuple):
    """A flat batch of samples, [N, ...]: what one loss evaluation consumes."""
    obs: jax.Array
    carry: Any
    rollout_extras: Any
    log_prob: jax.Array
    value: jax.Array
    advantage: jax.Array
    returns: jax.Array


def rollout_batch(t: Transition, advantages: jax.Array, returns: jax.Array) -> Batch:
    """The rollout as one flat batch of samples, [T * B, ...]."""
    return flatten_steps(Batch(t.obs, t.carry, t.rollout_extras, t.output["log_prob"],
                               t.output["value"], advantages, returns))


def replay(graphdef, params, rest, batch: Batch) -> tuple[Output, Any]:
    """Recompute the rollout's outputs for a batch of samples: (network output, rest).

    A feed-forward network needs only what was stored for each sample (observation, carry,
    raw action), so samples can be shuffled freely across steps and envs.
    """
    # copy=True: fresh variables under jax.grad, so that a module which breaks the write rule
    # shows up as a replay mismatch rather than as an NNX trace-level error
    model = nnx.merge(graphdef, params, rest, copy=True)
    out = model(batch.carry, batch.obs, batch.rollout_extras)
    return out, non_params(model)


def epoch_permutations(key, batch_size: int, update_epochs: int) -> jax.Array:
    """One shuffle of the batch per epoch, [update_epochs, batch_size].

    Drawn in a small loop of their own, before the epoch loop, and never inside a loop body that
    holds other loops: with jax 0.10.2 on CPU, a random draw there (an out-of-line call) made the
    vmapped training program deadlock at random, measured on these machines.
    """

    def draw(key, _):
        key, subkey = jax.random.split(key)
        return key, jax.random.permutation(subkey, batch_size)

    return jax.lax.scan(draw, key, length=update_epochs)[1]


def split_minibatches(batch: Batch, permutation: jax.Array, num_minibatches: int) -> Batch:
    """Reorder a flat batch and cut it into [num_minibatches, minibatch_size, ...]."""
    return jax.tree.map(
        lambda x: x[permutation].reshape((num_minibatches, -1) + x.shape[1:]), batch)


def ppo_loss(params, rest, graphdef, batch: Batch, args: Args):
    """CleanRL's PPO loss on a minibatch, via the replay pass."""
    out, rest = replay(graphdef, params, rest, batch)
    new_log_prob, entropy, new_value = (out.output[k] for k in ("log_prob", "entropy", "value"))
    log_ratio = new_log_prob - batch.log_prob
    ratio = jnp.exp(log_ratio)

    advantage = batch.advantage
    if args.norm_adv:
        advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
    policy_loss = jnp.maximum(
        -advantage * ratio,
        -advantage * jnp.clip(ratio, 1 - args.clip_coef, 1 + args.clip_coef)).mean()

    value_loss = (new_value - batch.returns) ** 2
    if args.clip_vloss:
        clipped = batch.value + jnp.clip(new_value - batch.value, -args.clip_coef, args.clip_coef)
        value_loss = jnp.maximum(value_loss, (clipped - batch.returns) ** 2)
    value_loss = 0.5 * value_loss.mean()

    entropy_loss = entropy.mean()
    loss = (policy_loss - args.ent_coef * entropy_loss + args.vf_coef * value_loss
            + out.regularization_loss.mean())
    metrics = {
        "losses/value_loss": value_loss,
        "losses/policy_loss": policy_loss,
        "losses/entropy": entropy_loss,
        "losses/old_approx_kl": (-log_ratio).mean(),
        "losses/approx_kl": ((ratio - 1) - log_ratio).mean(),
        "losses/clipfrac": (jnp.abs(ratio - 1.0) > args.clip_coef).mean(),
        **out.metrics,
    }
    return loss, (metrics, rest)


# ----------------------------------------------------------------------------------------------
# Update
# ----------------------------------------------------------------------------------------------
def make_optimizer(args: Args):
    """Adam with global-norm clipping; returns (optimizer, lr of the i-th iteration).

    The learning rate anneals linearly per iteration, as in CleanRL: it is a function of the
    optimizer's update count, which advances epochs * minibatches times per iteration.
    """
    updates_per_iteration = args.update_epochs * args.num_minibatches

    def learning_rate(count):
        if not args.anneal_lr:
            return jnp.asarray(args.learning_rate, jnp.float32)
        iteration = count // updates_per_iteration
        return args.learning_rate * (1.0 - iteration / args.num_iterations)

    # flatten: one vector instead of a dozen small leaves, so each step runs a few large kernels
    optimizer = optax.flatten(optax.chain(optax.clip_by_global_norm(args.max_grad_norm),
                                          optax.adam(learning_rate, eps=1e-5)))
    return optimizer, lambda i: learning_rate(i * updates_per_iteration)


def update(graphdef, optimizer, params, rest, opt_state, batch: Batch, key, args: Args):
    """update_epochs passes of shuffled minibatch gradient steps; metrics averaged over all."""

    def minibatch_step(state, minibatch):
        params, rest, opt_state = state
        grads, (metrics, rest) = jax.grad(ppo_loss, has_aux=True)(
            params, rest, graphdef, minibatch, args)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), rest, opt_state), metrics

    def epoch(state, permutation):
        minibatches = split_minibatches(batch, permutation, args.num_minibatches)
        return jax.lax.scan(minibatch_step, state, minibatches)

    permutations = epoch_permutations(key, args.batch_size, args.update_epochs)
    (params, rest, opt_state), metrics = jax.lax.scan(epoch, (params, rest, opt_state),
                                                      permutations)
    return params, rest, opt_state, jax.tree.map(jnp.mean, metrics)


# ----------------------------------------------------------------------------------------------
# Training loop
# ----------------------------------------------------------------------------------------------
class TrainState(NamedTuple):
    params: Any  # nnx.State of the nnx.Param variables
    rest: Any  # the model's other state (its nnx.Rngs, read only by initialize_state)
    opt_state: Any
    runner: Runner


def make_train(args: Args, report=None, report_every: int = 1):
    """Build `train(key, seed_index=0) -> (final TrainState, metrics)`, pure and jittable.

    All of training is one program: `jax.jit(train)` compiles it once and `jax.vmap(train)` trains
    many seeds at once. `metrics` maps CleanRL's names to arrays of shape [num_iterations].
    `report(seed_index, metrics)`, if given, is called on the host after every `report_every`
    iterations (and the last); the seed index only labels those reports. A host call costs about
    a millisecond on CPU, a fifth of a CartPole iteration, so report sparingly.
    """
    check_args(args)
    env, env_params = make_env(args.env_id, args.mask_velocity)
    optimizer, learning_rate = make_optimizer(args)

    def train(key, seed_index=0):
        # Re-key with Philox: jax's default Threefry lowers to a rolled loop on CPU, and the
        # rollout's per-step draws then cost about as much as the network itself.
        key = jax.random.key(jax.random.bits(key, dtype=jnp.uint32), impl="philox2x32")
        init_key, reset_key, runner_key, update_key = jax.random.split(key, 4)
        model = build_model(args, env, env_params, nnx.Rngs(init_key))
        carry = model.initialize_state(args.num_envs)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # the only graph walk
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(reset_key, args.num_envs), env_params)
        runner = Runner(env_state, flatten_obs(obs), carry, jnp.zeros(args.num_envs),
                        jnp.zeros(args.num_envs, jnp.int32), runner_key)

        def iteration(state: TrainState, xs):
            i, update_key = xs
            rest, runner, transitions = rollout(graphdef, state.params, state.rest, env,
                                                env_params, state.runner, args.num_steps)
            t = transitions
            model = nnx.merge(graphdef, state.params, rest)
            advantages, returns = compute_gae(t.reward, t.output["value"],
                                              bootstrap_values(model, t), t.terminated,
                                              t.truncated, args.gamma, args.gae_lambda)
            batch = rollout_batch(t, advantages, returns)
            params, rest, opt_state, metrics = update(
                graphdef, optimizer, state.params, rest, state.opt_state, batch,
                update_key, args)

            done = t.terminated | t.truncated
            episodes = done.sum()
            metrics.update({
                "global_step": (i + 1) * args.batch_size,
                "charts/episodic_return": jnp.where(
                    episodes > 0, t.episode_return.sum() / episodes, jnp.nan),
                "charts/episodic_length": jnp.where(
                    episodes > 0, t.episode_length.sum() / episodes, jnp.nan),
                "charts/learning_rate": learning_rate(i),
                "losses/explained_variance": jnp.where(  # NaN for constant returns, as CleanRL
                    jnp.var(returns) > 0,
                    1.0 - jnp.var(returns - t.output["value"]) / jnp.var(returns), jnp.nan),
            })
            if report is not None:
                due = ((i + 1) % report_every == 0) | (i + 1 == args.num_iterations)
                jax.lax.cond(due, lambda: jax.debug.callback(report, seed_index, metrics),
                             lambda: None)
            return TrainState(params, rest, opt_state, runner), metrics

        state = TrainState(params, rest, optimizer.init(params), runner)
        # per-iteration keys drawn up front, outside the loop (see epoch_permutations)
        update_keys = jax.random.split(update_key, args.num_iterations)
        return jax.lax.scan(iteration, state, (jnp.arange(args.num_iterations), update_keys))

    return train


def final_return(metrics: dict) -> np.ndarray:
    """Mean episodic return over the last 5% of iterations (per seed if metrics are stacked)."""
    returns = np.asarray(metrics["charts/episodic_return"])
    last = returns[..., -max(1, returns.shape[-1] // 20):]
    ended = (~np.isnan(last)).sum(-1)  # NaN where no episode ended in the window
    return np.where(ended > 0, np.nansum(last, -1) / np.maximum(ended, 1), np.nan)


def first_nonfinite(args: Args, params, metrics: dict) -> Optional[str]:
    """Where a run went NaN or infinite, in one line; None if it never did.

    Reads what the compiled program returned (leading seed axis): every loss per iteration, then
    the final parameters, so the loop carries nothing extra. A NaN gradient shows in the losses
    of the next minibatch (so, at an iteration's last minibatch, of the next iteration).
    """
    names = [k for k in metrics if k.startswith("losses/") and k != "losses/explained_variance"]
    bad = np.stack([~np.isfinite(np.asarray(metrics[k])) for k in names], -1)  # [S, I, metric]
    bad_params = ~np.all([np.isfinite(x.reshape(x.shape[0], -1)).all(-1)
                          for x in jax.tree.leaves(params)], axis=0)  # [S]
    if bad.any():
        seed, iteration, metric = min(zip(*np.nonzero(bad)), key=lambda sim: (sim[1], sim[2]))
        what = f"{names[metric]} is {float(metrics[names[metric]][seed, iteration])}"
    elif bad_params.any():
        seed, iteration = np.argmax(bad_params), args.num_iterations - 1
        what = "the parameters are not finite"
    else:
        return None
    return (f"seed {args.seed + seed}: {what} at iteration {iteration + 1} of "
            f"{args.num_iterations} (global_step {(iteration + 1) * args.batch_size}); "
            "the run diverged")


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------
class Progress:
    """Host side of `report`: W&B gets every report; the console a line about once a second,
    with every seed's latest return, once all seeds have reached that step."""

    def __init__(self, args: Args):
        self.args, self.wandb_runs = args, []  # main fills in the W&B runs with --track
        self.latest_return = np.full(args.num_seeds, np.nan)
        self.done = np.zeros(args.num_seeds, int)
        self.total = args.num_iterations * args.batch_size
        self.start = self.last_print = None

    def __call__(self, seed_index, metrics):
        now = time.time()
        seed_index = int(seed_index)
        metrics = {k: float(v) for k, v in metrics.items()}
        if self.wandb_runs:
            self.wandb_runs[seed_index].log(metrics)
        if not math.isnan(metrics["charts/episodic_return"]):
            self.latest_return[seed_index] = metrics["charts/episodic_return"]
        self.done[seed_index] = step = int(metrics["global_step"])
        if self.done.min() < step:  # print a step once every seed has reached it
            return
        if self.last_print is None or now - self.last_print >= 1.0 or step == self.total:
            self.last_print, elapsed = now, max(now - self.start, 1e-9)
            returns = " ".join(f"{r:.1f}" for r in self.latest_return)
            print(f"global_step={step:>9d} ({step / self.total:4.0%}, "
                  f"{elapsed * (self.total - step) / step:.0f} s left)  "
                  f"episodic_return={returns}  SPS={step * self.args.num_seeds / elapsed:,.0f}",
                  flush=True)


def init_wandb(args: Args):
    """One W&B run per seed, named the CleanRL way and grouped, so every curve stays visible.

    Without credentials, or when W&B cannot be reached, the runs are logged offline
    (`wandb sync` uploads them later): a run never waits on a login prompt.
    """
    import wandb

    def offline(why: str) -> str:
        print(f"notice: --track {why}; logging offline to ./wandb, `wandb sync` uploads it later",
              file=sys.stderr)
        return "offline"

    mode = None  # W&B's own choice: WANDB_MODE, else online
    if (os.environ.get("WANDB_MODE") not in ("offline", "disabled")
            and not wandb.login(prompt=False, verify=False)):
        mode = offline("found no W&B credentials (`wandb login` or WANDB_API_KEY)")
    stamp = int(time.time())
    runs = []
    for i in range(args.num_seeds):
        seed = args.seed + i
        settings = dict(
            project=args.wandb_project_name, entity=args.wandb_entity,
            name=f"{args.env_id}__{args.exp_name}__{seed}__{stamp}",
            group=f"{args.env_id}__{args.exp_name}__{stamp}",
            config={**dataclasses.asdict(args), "seed": seed, "batch_size": args.batch_size,
                    "minibatch_size": args.minibatch_size, "num_iterations": args.num_iterations},
            save_code=True, reinit="create_new")
        try:
            run = wandb.init(mode=mode, **settings)
        except wandb.errors.Error as error:  # e.g. no network, or a key the server rejects
            mode = offline(f"could not reach W&B ({str(error).splitlines()[0]})")
            run = wandb.init(mode=mode, **settings)
        run.define_metric("*", step_metric="global_step")
        runs.append(run)
    return runs


def main(args: Args) -> None:
    try:
        check_args(args)  # also done by make_train; here so the sizes below are safe to use
        progress = Progress(args)
        # W&B gets every iteration, as in CleanRL; the console needs about a hundred updates.
        report_every = 1 if args.track else max(1, args.num_iterations // 100)
        train = make_train(args, progress, report_every)  # checks the env
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if args.track:
        progress.wandb_runs = init_wandb(args)
    seeds = args.seed + np.arange(args.num_seeds)
    keys = jax.vmap(jax.random.key)(jnp.asarray(seeds))  # seed i of N draws what --seed i draws

    def train_seeds(keys, seed_indices):  # metrics get a leading seed axis either way
        if args.num_seeds == 1:  # a vmap over one seed costs speed on CPU
            return jax.tree.map(lambda x: x[None], train(keys[0], seed_indices[0]))
        return jax.vmap(train)(keys, seed_indices)

    start = time.time()
    compiled = jax.jit(train_seeds).lower(keys, jnp.arange(args.num_seeds)).compile()
    compile_time = time.time() - start
    start = progress.start = time.time()
    state, metrics = jax.block_until_ready(compiled(keys, jnp.arange(args.num_seeds)))
    train_time = time.time() - start

    steps = args.num_iterations * args.batch_size
    finals = final_return(metrics)
    failure = first_nonfinite(args, state.params, metrics)
    for run, final in zip(progress.wandb_runs, finals):
        run.summary["final_episodic_return"] = float(final)
        run.finish(exit_code=1 if failure else 0)
    print(f"summary: env={args.env_id} seeds={seeds.tolist()} "
          f"final_episodic_return={[round(float(r), 2) for r in finals]} "
          f"env_steps={steps * args.num_seeds} compile_s={compile_time:.1f} "
          f"train_s={train_time:.1f} SPS={steps * args.num_seeds / train_time:,.0f}")
    if failure:
        print(f"error: {failure}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(tyro.cli(Args))
