"""Recurrent PPO for gymnax: ppo_nnx.py plus an NNX LSTM and a variational bottleneck.

    python ppo_nnx_vae_lstm.py --env-id CartPole-v1 --mask-velocity  # a task that needs memory

The loss replay recomputes the rollout's outputs from stored data; before the first gradient step
the two must agree, or PPO's ratio is wrong from the start. They agree even through random layers:
every draw comes from a per-env key in the network's carry, stored and sliced with the data, and
every sampled action is stored in `rollout_extras` and re-scored, never re-sampled.
With memory, the carry also holds the LSTM state: replay re-runs whole sequences from the stored
start carry, resetting where the rollout reset. `diff` this file with ppo_nnx.py to see the cost.
"""

import concurrent.futures
import contextlib
import dataclasses
import functools
import glob
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import namedtuple
from typing import Any, Literal, NamedTuple, Optional

import jax

if "JAX_COORDINATOR_ADDRESS" in os.environ:  # many hosts: see the README (None: SLURM's, MPI's)
    jax.distributed.initialize(None, *[int(os.environ[k]) if k in os.environ else None
                                       for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID")])
import gymnax  # after jax.distributed: importing gymnax starts jax's backend
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import tyro
from flax import nnx
from gymnax.environments import spaces
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

# Shardy (jax 0.11) fails to lower Philox's mulhi inside shard_map: partition with GSPMD
jax.config.update("jax_use_shardy_partitioner", False)


# ======================================== Arguments ========================================
@dataclasses.dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # the name of this experiment
    seed: int = 1  # seed of the experiment (with --num-seeds N: seed .. seed+N-1)
    track: bool = False  # if toggled, this experiment will be tracked with Weights and Biases
    wandb_project_name: str = "ppo-nnx"  # the wandb's project name
    wandb_entity: Optional[str] = None  # the entity (team) of wandb's project
    env_id: str = "CartPole-v1"  # the id of the gymnax environment
    mask_velocity: bool = False  # hide velocities (CartPole-v1, Pendulum-v1): needs memory
    total_timesteps: int = 1_000_000  # total env steps of the experiment (per seed)
    learning_rate: float = 1e-3  # the learning rate of the optimizer
    num_envs: int = 32  # the number of parallel game environments
    num_steps: int = 32  # the number of steps to run in each environment per policy rollout
    anneal_lr: bool = True  # toggle learning rate annealing for policy and value networks
    gamma: float = 0.98  # the discount factor gamma
    gae_lambda: float = 0.98  # the lambda for the general advantage estimation
    num_minibatches: int = 2  # the number of mini-batches, each a group of whole env sequences
    update_epochs: int = 4  # the K epochs to update the policy
    norm_adv: bool = True  # toggles advantages normalization
    clip_coef: float = 0.2  # the surrogate clipping coefficient
    clip_vloss: bool = True  # toggles whether or not to use a clipped loss for the value function
    ent_coef: float = 0.0  # coefficient of the entropy
    vf_coef: float = 0.5  # coefficient of the value function
    max_grad_norm: float = 0.5  # the maximum norm for the gradient clipping
    num_seeds: int = 1  # seeds trained at once by jax.vmap, in one compiled program, over devices
    shard_envs: bool = False  # one agent per seed, its envs split over all devices (data parallel)
    hidden_size: int = 64  # width of the hidden layers
    activation: Literal["tanh", "relu"] = "tanh"  # the hidden layers' nonlinearity (CleanRL: tanh)
    lstm_size: int = 32  # size of the LSTM's state
    latent_size: int = 16  # size of the VariationalBottleneck after the LSTM (0 = no bottleneck)
    kl_coef: float = 1e-3  # weight of the bottleneck's KL to N(0, I) in the loss
    norm_obs: Optional[bool] = None  # normalize observations (None: if actions are continuous)
    norm_reward: Optional[bool] = None  # scale rewards by the return's std (None: as above)
    save_model: bool = False  # save each seed's model and the training state to `runs/{run_name}`
    save_every: int = 0  # also save the training state every N iterations (0: when stopped only)
    resume: Optional[str] = None  # continue the stopped run saved in this `runs/{run_name}`
    chunk_iterations: int = 0  # iterations per compiled call; logs, saves, Ctrl-C between (0: ~1 s)
    eval_episodes: int = 0  # episodes per seed to evaluate the trained policy on (0: none)
    eval_deterministic: bool = False  # evaluate the most likely action (a bottleneck still samples)
    eval_checkpoint: Optional[str] = None  # evaluate this saved `runs/{run_name}`, no training

    batch_size = property(lambda self: self.num_envs * self.num_steps)
    seeds = property(lambda self: range(self.seed, self.seed + self.num_seeds))
    num_iterations = property(lambda self: self.total_timesteps // self.batch_size)
    chunk_size = property(lambda self: self.chunk_iterations or min(self.num_iterations, 1000))
    env_axis = property(lambda self: "envs" if self.shard_envs else ())  # to average over devices
    local_envs = property(lambda self: self.num_envs // (jax.device_count() if self.shard_envs
                                                         else 1))  # the envs of one device


def check_args(args: Args) -> Args:
    """Reject, naming the flag, what would fail deep in JAX or train silently wrong; fill Nones."""
    for rule, ok, names in [
            ("> 0", lambda v: v > 0, "total_timesteps num_envs num_steps num_minibatches "
                                     "update_epochs num_seeds hidden_size lstm_size"),
            (">= 0", lambda v: v >= 0,  # NaN fails too
             "latent_size learning_rate clip_coef ent_coef vf_coef max_grad_norm kl_coef "
             "eval_episodes save_every chunk_iterations"),
            ("in [0, 1]", lambda v: 0 <= v <= 1, "gamma gae_lambda")]:
        for name in names.split():
            if not ok(getattr(args, name)):
                raise ValueError(f"--{name.replace('_', '-')} must be {rule}, "
                                 f"got {getattr(args, name)}")
    if args.activation not in ACTIVATIONS:
        raise ValueError(f"--activation must be one of {', '.join(ACTIVATIONS)}, got "
                         f"{args.activation!r}")
    if not (args.eval_checkpoint or args.resume):  # a saved run: its own flags are checked
        devices(args)
        if args.local_envs % args.num_minibatches:
            raise ValueError(f"--num-minibatches {args.num_minibatches} must divide --num-envs "
                             f"{args.num_envs} ({args.local_envs} per device): whole env sequences")
    if args.total_timesteps < args.batch_size:
        raise ValueError(f"--total-timesteps {args.total_timesteps} is below one batch "
                         f"(--num-envs * --num-steps = {args.batch_size})")
    updates = args.num_iterations * args.update_epochs * args.num_minibatches
    if updates >= 2**31:  # optax counts them in int32
        raise ValueError(f"--total-timesteps {args.total_timesteps} makes {updates:,} gradient "
                         f"steps, above the {2**31 - 1:,} that optax can count")
    if not -(2**31) <= args.seed <= 2**31 - args.num_seeds:  # JAX seeds are int32
        raise ValueError(f"--seed {args.seed} must be in [-2**31, 2**31 - --num-seeds]")
    if args.norm_adv and args.batch_size // args.num_minibatches < 2:
        raise ValueError(f"--num-minibatches {args.num_minibatches} leaves one sample per "
                         "minibatch, whose normalized advantage is 0: use fewer, or --no-norm-adv")
    if args.exp_name in ("", ".", "..") or os.path.basename(args.exp_name) != args.exp_name:
        raise ValueError(f"--exp-name {args.exp_name!r} must be a plain name: it names a folder in "
                         "runs/")
    if args.resume and args.eval_checkpoint:
        raise ValueError("--resume trains and --eval-checkpoint does not: give one of them")
    env, env_params = make_env(args)
    on = not isinstance(env.action_space(env_params), spaces.Discrete)
    return dataclasses.replace(args, **{k: on for k in ("norm_obs", "norm_reward")
                                        if getattr(args, k) is None})


def devices(args: Args) -> list:
    """The devices (of all hosts) sharing the seeds or, with --shard-envs, the envs equally."""
    n, flag = (args.num_envs, "num-envs") if args.shard_envs else (args.num_seeds, "num-seeds")
    if n == 1 and not args.shard_envs and jax.process_count() == 1:
        return jax.devices()[:1]
    if n % jax.device_count():
        raise ValueError(f"--{flag} {n} must be a multiple of the {jax.device_count()} devices "
                         "(CUDA_VISIBLE_DEVICES or JAX_PLATFORMS=cpu can show fewer)")
    return sorted(jax.devices(), key=lambda d: d.process_index)  # each host's seeds in a row


# ========================================= Modules =========================================
class Output(NamedTuple):
    next_state: Any  # the carry for the next step, [B, ...]
    output: Any  # what the caller consumes
    regularization_loss: jax.Array  # [B], added to the PPO loss
    metrics: dict  # scalars worth logging
    rollout_extras: Any  # what replay needs to reproduce this call


class StatefulModule(nnx.Module):
    """Per-env state travels in an explicit carry, [B, ...], not in NNX variables.

    `__call__(carry, x, rollout_extras=None) -> Output` samples afresh and emits `rollout_extras`
    when given None (rollout, inference), and consumes the stored ones (loss replay). Write rule:
    it never writes a variable that shapes its output. A container names its stateful children in
    `stateful`; its carry holds an entry for each.
    """
    stateful: tuple = ()

    def initialize_state(self, batch_size: int) -> Any:
        return {name: getattr(self, name).initialize_state(batch_size) for name in self.stateful}

    def reset_state(self, carry: Any) -> Any:  # the carry of an env whose episode just ended
        return {n: getattr(self, n).reset_state(carry[n]) for n in self.stateful} or carry

    def unroll(self, carry: Any, xs: Any, done: jax.Array, rollout_extras: Any = None) -> Output:
        """T calls on [T, B, ...] from `carry`, reset after `done` steps (`next_state`: before the
        reset). Loss replay runs this; overrides batch what does not depend on the last step."""

        def step(carry, inputs):
            x, done, rollout_extras = inputs
            out = self(carry, x, rollout_extras)
            return carry_after_step(self, out.next_state, done), out

        return jax.lax.scan(step, carry, (xs, done, rollout_extras))[1]


def carry_after_step(module: StatefulModule, next_state: Any, done: jax.Array) -> Any:
    """The next step's carry: reset in the envs whose episode ended (`done`, [B])."""
    return jax.tree.map(lambda r, k: jnp.where(done.reshape(done.shape + (1,) * (k.ndim - 1)),
                                               r, k), module.reset_state(next_state), next_state)


def rows(layer, x: jax.Array) -> jax.Array:  # layer on [T, B, n] as [T * B, n]: a 3-D dot's
    return layer(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1] + (-1,))  # gradient is slow


def flatten_steps(tree):  # [T, B, ...] -> [T * B, ...]
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tree)


def split_per_env(keys: jax.Array) -> tuple[jax.Array, jax.Array]:  # (next keys, keys to use)
    return tuple(jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0))


def normal_per_env(keys: jax.Array, like: jax.Array) -> jax.Array:  # row b from keys[b] alone
    noise = jax.vmap(lambda key: jax.random.normal(key, like.shape[1:]))(keys)
    return jax.lax.optimization_barrier(noise)  # drawn once: XLA copied it into each consumer


class KeyCarryModule(StatefulModule):
    """A random module whose carry is one PRNG key per env, [B], split on every call: stored and
    sliced with the data, the keys give replay the rollout's draws in any minibatch. `self.rngs`
    only seeds them (drawn from in `__call__`, it gives replay other noise). Resets keep them."""

    def __init__(self, rngs: nnx.Rngs):
        self.rngs = rngs

    def initialize_state(self, batch_size: int) -> jax.Array:
        return jax.random.split(self.rngs(), batch_size)

    def unroll(self, carry, xs, done, rollout_extras=None):
        """All T steps in one call on [T * B] rows: the keys do not depend on the inputs."""

        def advance(key, done):
            return carry_after_step(self, split_per_env(key)[0], done), key

        keys = jax.lax.scan(advance, carry, done)[1]
        out = self(flatten_steps(keys), flatten_steps(xs), flatten_steps(rollout_extras))
        steps = lambda tree: jax.tree.map(lambda x: x.reshape(done.shape + x.shape[1:]), tree)
        return Output(*map(steps, out[:3]), out.metrics, steps(out.rollout_extras))


ACTIVATIONS = {"tanh": jnp.tanh, "relu": jax.nn.relu}  # --activation


def mlp(sizes: list[int], out_scale: float, activation, rngs: nnx.Rngs) -> nnx.Sequential:
    """Linear layers with `activation` between them, CleanRL's orthogonal initialization."""
    scales = [math.sqrt(2)] * (len(sizes) - 2) + [out_scale]
    layers = [nnx.Linear(n_in, n_out, kernel_init=nnx.initializers.orthogonal(scale),
                         bias_init=nnx.initializers.zeros_init(), rngs=rngs)
              for n_in, n_out, scale in zip(sizes[:-1], sizes[1:], scales)]
    return nnx.Sequential(*[f for layer in layers for f in (layer, activation)][:-1])


class LSTM(StatefulModule):
    """nnx's LSTM cell behind the protocol: the carry (cell, hidden) resets to zeros."""

    def __init__(self, in_size: int, lstm_size: int, rngs: nnx.Rngs):
        self.cell = nnx.OptimizedLSTMCell(in_size, lstm_size, rngs=rngs)
        self.lstm_size = lstm_size

    def initialize_state(self, batch_size):
        return (jnp.zeros((batch_size, self.lstm_size)),) * 2

    def reset_state(self, carry):
        return jax.tree.map(jnp.zeros_like, carry)

    def cell_step(self, carry, projected_x):  # OptimizedLSTMCell's arithmetic, dense_i(x) given
        c, h = carry
        i, f, g, o = jnp.split(projected_x + self.cell.dense_h(h), 4, axis=-1)
        c = self.cell.gate_fn(f) * c + self.cell.gate_fn(i) * self.cell.activation_fn(g)
        return c, self.cell.gate_fn(o) * self.cell.activation_fn(c)

    def __call__(self, carry, x, rollout_extras=None):
        c, h = self.cell_step(carry, self.cell.dense_i(x))
        return Output((c, h), h, jnp.zeros(x.shape[0]), {}, ())

    def unroll(self, carry, xs, done, rollout_extras=None):
        """The input product of all T steps at once; only the recurrent product steps in time."""

        def step(carry, inputs):
            projected_x, done = inputs
            next_carry = self.cell_step(carry, projected_x)
            return carry_after_step(self, next_carry, done), next_carry

        next_carries = jax.lax.scan(step, carry, (rows(self.cell.dense_i, xs), done))[1]
        return Output(next_carries, next_carries[1], jnp.zeros(done.shape), {}, ())


class VariationalBottleneck(KeyCarryModule):
    """z = mean + std * eps, eps from the per-env key, with the KL to N(0, I) as a loss."""

    def __init__(self, in_size: int, latent_size: int, kl_coef: float, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.mean = nnx.Linear(in_size, latent_size, rngs=rngs)
        self.pre_std = nnx.Linear(in_size, latent_size, rngs=rngs)
        self.kl_coef = kl_coef

    def __call__(self, key, x, rollout_extras=None):
        next_key, noise_key = split_per_env(key)
        mean, std = self.mean(x), jax.nn.softplus(self.pre_std(x)) + 1e-6
        kl = 0.5 * jnp.sum(mean**2 + std**2 - 1.0 - 2.0 * jnp.log(std), axis=-1)
        return Output(next_key, mean + std * normal_per_env(noise_key, mean), self.kl_coef * kl,
                      {"losses/kl": kl.mean()}, ())


class CategoricalSampler(KeyCarryModule):
    """A discrete action from logits; replay re-scores the stored action."""

    def __call__(self, key, logits, rollout_extras=None):
        next_key, sample_key = split_per_env(key)
        action = (jax.vmap(jax.random.categorical)(sample_key, logits)
                  if rollout_extras is None else rollout_extras)
        log_probs = jax.nn.log_softmax(logits)
        # a one-hot product, not an index: its gradient avoids a slow scatter on CPU
        log_prob = jnp.sum(jax.nn.one_hot(action, logits.shape[-1]) * log_probs, axis=-1)
        entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
        return Output(next_key, dict(action=action, log_prob=log_prob, entropy=entropy,
                                     mode=logits.argmax(-1)), jnp.zeros_like(log_prob), {}, action)


class GaussianSampler(KeyCarryModule):
    """A diagonal Gaussian with a state-independent log-std, as in CleanRL's continuous PPO. The
    raw sample is stored and scored; the env gets it clipped (which has another density)."""

    def __init__(self, action_dim: int, low: tuple, high: tuple, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.log_std = nnx.Param(jnp.zeros(action_dim))
        self.low, self.high = low, high

    def __call__(self, key, mean, rollout_extras=None):
        next_key, sample_key = split_per_env(key)
        log_std = self.log_std[...]
        std = jnp.exp(log_std)
        raw = (mean + std * normal_per_env(sample_key, mean) if rollout_extras is None
               else rollout_extras)
        log_prob = jnp.sum(-0.5 * ((raw - mean) / std) ** 2 - log_std - 0.5 * math.log(2 * math.pi),
                           axis=-1)
        entropy = jnp.broadcast_to(jnp.sum(0.5 + 0.5 * math.log(2 * math.pi) + log_std),
                                   log_prob.shape)
        clip = lambda a: jnp.clip(a, jnp.asarray(self.low), jnp.asarray(self.high))
        return Output(next_key, dict(action=clip(raw), log_prob=log_prob, entropy=entropy,
                                     mode=clip(mean)), jnp.zeros_like(log_prob), {}, raw)


class ActorCritic(StatefulModule):
    """Encoder, LSTM, optional bottleneck, then actor and critic heads (values are random too)."""

    def __init__(self, obs_size: int, action_head: int, sampler: StatefulModule, args: Args,
                 rngs: nnx.Rngs):
        h, act = args.hidden_size, ACTIVATIONS[args.activation]
        self.encoder = mlp([obs_size, h], math.sqrt(2), act, rngs)
        self.lstm = LSTM(h, args.lstm_size, rngs)
        self.bottleneck = (VariationalBottleneck(args.lstm_size, args.latent_size, args.kl_coef,
                                                 rngs) if args.latent_size else None)
        self.actor_head = mlp([args.latent_size or args.lstm_size, h, action_head], 0.01, act,
                              rngs)
        self.sampler = sampler
        self.critic = mlp([args.latent_size or args.lstm_size, h, 1], 1.0, act, rngs)
        self.activation = act
        self.stateful = ("lstm",) + (("bottleneck",) if args.latent_size else ()) + ("sampler",)

    def __call__(self, carry, obs, rollout_extras=None, done=None):
        """One step; or, given `done` [T, B], a whole sequence through the children's `unroll`."""
        outs = {}

        def run(name, x):
            extras = None if rollout_extras is None else rollout_extras[name]
            child = getattr(self, name)
            outs[name] = (child(carry[name], x, extras) if done is None
                          else child.unroll(carry[name], x, done, extras))
            return outs[name].output

        hidden = run("lstm", self.activation(rows(self.encoder, obs)))
        if self.bottleneck is not None:
            hidden = run("bottleneck", hidden)
        output = dict(run("sampler", rows(self.actor_head, hidden)),
                      value=rows(self.critic, hidden)[..., 0])
        if self.bottleneck is not None:
            output["latent"] = hidden
        return Output({n: out.next_state for n, out in outs.items()}, output,
                      sum(out.regularization_loss for out in outs.values()),
                      {k: v for out in outs.values() for k, v in out.metrics.items()},
                      {n: out.rollout_extras for n, out in outs.items()})


# ======================================= Environment =======================================
POSITIONS = {"CartPole-v1": [0, 2], "Pendulum-v1": [0, 1]}  # what --mask-velocity keeps


def make_env(args: Args):
    """gymnax.make, with errors that name the flag: (env, env_params)."""
    if args.env_id not in gymnax.registered_envs:
        raise ValueError(f"--env-id {args.env_id!r} is not a gymnax environment; choose one of: "
                         + ", ".join(gymnax.registered_envs))
    if args.mask_velocity and args.env_id not in POSITIONS:
        raise ValueError(f"--mask-velocity supports --env-id {' or '.join(POSITIONS)}, "
                         f"not {args.env_id}")
    try:
        return gymnax.make(args.env_id)
    except Exception as error:  # e.g. an env that downloads its data, on an offline machine
        raise ValueError(f"--env-id {args.env_id}: gymnax could not build it ({error})") from None


def observe(obs: jax.Array, args: Args, norm=None) -> jax.Array:
    """[B, ...] env observations as [B, features] float32 inputs, masked with --mask-velocity and,
    given the statistics `norm`, normalized with --norm-obs."""
    obs = obs.reshape(obs.shape[0], -1).astype(jnp.float32)
    obs = obs[:, POSITIONS[args.env_id]] if args.mask_velocity else obs
    return (jnp.clip((obs - norm.obs["mean"]) / jnp.sqrt(norm.obs["var"] + 1e-8), -10, 10)
            if norm is not None and args.norm_obs else obs)


# Running moments (mean, var, count) of observations and of discounted returns, as gym's wrappers
Norm = namedtuple("Norm", "obs ret discounted")  # and the discounted returns themselves, [B]


def moments(x: jax.Array, args: Args):  # (mean, variance) over axis 0 and the envs of all devices
    mean = jax.lax.pmean(x.mean(0), args.env_axis)
    return mean, jax.lax.pmean(((x - mean) ** 2).mean(0), args.env_axis)


def update_moments(m: dict, x: jax.Array, args: Args) -> dict:  # merge in a batch x, [B, ...]
    (mean, var), n = moments(x, args), x.shape[0] * jax.lax.psum(1, args.env_axis)
    delta, count = mean - m["mean"], m["count"] + n
    return dict(mean=m["mean"] + delta * n / count, count=count, var=(m["var"] * m["count"]
                + var * n + delta**2 * m["count"] * n / count) / count)


def init_norm(obs: jax.Array, args: Args) -> Norm:  # having seen the reset observations, as gym
    new = lambda x: dict(mean=jnp.zeros_like(x[0]), var=jnp.ones_like(x[0]), count=jnp.array(1e-4))
    return Norm(update_moments(new(obs), obs, args) if args.norm_obs else new(obs), new(obs[:, 0]),
                jnp.zeros(len(obs)))


def update_norm(norm: Norm, obs, reward, done, args: Args):
    """(statistics after a step, updated between network calls; with them, its rewards scaled)"""
    discounted = norm.discounted * args.gamma + reward
    norm = Norm(update_moments(norm.obs, obs, args) if args.norm_obs else norm.obs,
                update_moments(norm.ret, discounted, args) if args.norm_reward else norm.ret,
                jnp.where(done, 0.0, discounted) if args.norm_reward else norm.discounted)
    return norm, (jnp.clip(reward / jnp.sqrt(norm.ret["var"] + 1e-8), -10, 10) if args.norm_reward
                  else reward)


def build_model(args: Args, env, env_params, rngs: nnx.Rngs) -> ActorCritic:
    """The actor-critic for this env; the sampler follows from the action space."""
    obs_size = observe(jnp.zeros((1,) + env.observation_space(env_params).shape), args).shape[1]
    with jax.ensure_compile_time_eval():  # bounds built with jnp stay concrete under jit
        space = env.action_space(env_params)
    if isinstance(space, spaces.Discrete):
        return ActorCritic(obs_size, space.n, CategoricalSampler(rngs), args, rngs)
    size = int(np.prod(space.shape))
    low, high = (tuple(np.broadcast_to(np.asarray(b, np.float32), (size,)).tolist())
                 for b in (space.low, space.high))
    return ActorCritic(obs_size, size, GaussianSampler(size, low, high, rngs), args, rngs)


# ========================================= Rollout =========================================
# What the rollout carries from one iteration to the next; the episode totals are [B] running sums
Runner = namedtuple("Runner", "env_state obs carry episode_return episode_length key norm")


class Transition(NamedTuple):  # one step of every env; the rollout stacks them into [T, B, ...]
    obs: jax.Array
    carry: Any  # the carry the network was called with
    rollout_extras: Any  # the raw sampled actions, keyed like the carry
    output: dict  # action, log_prob, entropy, value (and latent)
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    final_obs: jax.Array  # the observation the step led to, before any auto-reset
    episode_return: jax.Array  # of the episode that ended at this step, else 0
    episode_length: jax.Array
    next_carry: Any  # the carry the network returned, before any reset: the bootstrap's


def this_device(x, args: Args):  # of the rows of all envs, this device's (--shard-envs)
    index = jax.lax.axis_index("envs") * args.local_envs if args.shard_envs else 0
    return jax.lax.dynamic_slice_in_dim(x, index, args.local_envs)


def merge(graphdef, params, rest) -> ActorCritic:  # fresh variables: no write leaves a pass
    return nnx.merge(graphdef, params, rest, copy=True)


def rollout(graphdef, params, rest, env, env_params, runner: Runner, args: Args):
    """Act for num_steps in every env: (runner, [T, B] transitions)."""

    def step(runner: Runner, _):
        model = merge(graphdef, params, rest)
        out = model(runner.carry, runner.obs)
        key, step_key = jax.random.split(runner.key)
        obs, env_state, reward, terminated, truncated, info = jax.vmap(
            env.step, in_axes=(0, 0, 0, None))(this_device(jax.random.split(
                step_key, args.num_envs), args), runner.env_state, out.output["action"], env_params)
        done = terminated | truncated
        norm, scaled = update_norm(runner.norm, observe(obs, args), reward, done, args)
        episode_return, episode_length = runner.episode_return + reward, runner.episode_length + 1
        transition = Transition(  # the network's inputs (normalized); returns as scored (not)
            runner.obs, runner.carry, out.rollout_extras, out.output, scaled, terminated,
            truncated, observe(info["final_observation"], args, norm),
            jnp.where(done, episode_return, 0.0), jnp.where(done, episode_length, 0),
            out.next_state)
        return Runner(env_state, observe(obs, args, norm),
                      carry_after_step(model, out.next_state, done),
                      jnp.where(done, 0.0, episode_return), jnp.where(done, 0, episode_length),
                      key, norm), transition

    return jax.lax.scan(step, runner, length=args.num_steps)


# ======================================== Advantages =======================================
def bootstrap_values(model: ActorCritic, t: Transition) -> jax.Array:
    """V(final observation) of every step, [T, B], in one batched pass."""
    out = model(flatten_steps(t.next_carry), flatten_steps(t.final_obs))  # one step on from there
    return out.output["value"].reshape(t.reward.shape)


def compute_gae(t: Transition, next_values: jax.Array, args: Args):
    """GAE over [T, B]: (advantages, returns). `next_values` is V of the observation each step
    led to, before any auto-reset: a time limit bootstraps from it, termination does not."""

    def backward(next_advantage, step):
        reward, value, next_value, term, trunc = step
        delta = reward + args.gamma * next_value * (1.0 - term) - value
        advantage = delta + args.gamma * args.gae_lambda * (1.0 - (term | trunc)) * next_advantage
        return advantage, advantage

    values = t.output["value"]
    _, advantages = jax.lax.scan(backward, jnp.zeros_like(values[0]), (
        t.reward, values, next_values, t.terminated, t.truncated), reverse=True)
    return advantages, advantages + values


# ======================================= Loss replay =======================================
# What one loss evaluation consumes (rollout_batch says in what shape)
Batch = namedtuple("Batch", "obs carry rollout_extras done log_prob value advantage returns")


def rollout_batch(t: Transition, advantages: jax.Array, returns: jax.Array) -> Batch:
    """The rollout as whole sequences, [T, B, ...], with the carry of their first step, [B, ...]."""
    return Batch(t.obs, jax.tree.map(lambda x: x[0], t.carry), t.rollout_extras,
                 t.terminated | t.truncated, t.output["log_prob"], t.output["value"], advantages,
                 returns)


def replay(graphdef, params, rest, batch: Batch) -> Output:
    """The rollout's outputs, recomputed from what the rollout stored."""
    return merge(graphdef, params, rest)(batch.carry, batch.obs, batch.rollout_extras, batch.done)


def split_minibatches(batch: Batch, permutation: jax.Array, num_minibatches: int) -> Batch:
    """Shuffle the envs and cut them into groups of whole sequences: a sequence cut in the middle
    would need the carry there, which depends on the parameters being trained."""

    def split(x, axis):  # the env axis: 1 in [T, B, ...], 0 in the start carry
        x = jnp.take(x, permutation, axis=axis)
        return jnp.moveaxis(x.reshape(x.shape[:axis] + (num_minibatches, -1) + x.shape[axis + 1:]),
                            axis, 0)

    sequences = jax.tree.map(lambda x: split(x, 1), batch._replace(carry=()))
    return sequences._replace(carry=jax.tree.map(lambda x: split(x, 0), batch.carry))


def ppo_loss(graphdef, params, rest, batch: Batch, args: Args):
    """CleanRL's PPO loss on a minibatch, via the replay: (loss, metrics)."""
    out = replay(graphdef, params, rest, batch)
    log_ratio = out.output["log_prob"] - batch.log_prob
    ratio = jnp.exp(log_ratio)
    advantage = batch.advantage
    if args.norm_adv:
        mean, var = moments(advantage.reshape(-1), args)  # of the minibatch on every device
        advantage = (advantage - mean) / (jnp.sqrt(var) + 1e-8)
    policy_loss = jnp.maximum(
        -advantage * ratio,
        -advantage * jnp.clip(ratio, 1 - args.clip_coef, 1 + args.clip_coef)).mean()
    new_value = out.output["value"]
    value_loss = (new_value - batch.returns) ** 2
    if args.clip_vloss:
        clipped = batch.value + jnp.clip(new_value - batch.value, -args.clip_coef, args.clip_coef)
        value_loss = jnp.maximum(value_loss, (clipped - batch.returns) ** 2)
    value_loss = 0.5 * value_loss.mean()
    entropy = out.output["entropy"].mean()
    loss = (policy_loss - args.ent_coef * entropy + args.vf_coef * value_loss
            + out.regularization_loss.mean())
    return loss, {
        "losses/value_loss": value_loss, "losses/policy_loss": policy_loss,
        "losses/entropy": entropy, "losses/old_approx_kl": (-log_ratio).mean(),
        "losses/approx_kl": ((ratio - 1) - log_ratio).mean(),
        "losses/clipfrac": (jnp.abs(ratio - 1.0) > args.clip_coef).mean(), **out.metrics}


# ========================================== Update =========================================
def make_optimizer(args: Args):
    """Adam with global-norm clipping, and the learning rate of iteration i."""
    updates_per_iteration = args.update_epochs * args.num_minibatches

    def learning_rate(count):  # annealed linearly per iteration, as in CleanRL
        left = 1.0 - (count // updates_per_iteration) / args.num_iterations
        return args.learning_rate * (left if args.anneal_lr else jnp.ones_like(left))

    # flatten: one vector instead of a dozen small leaves, so each step runs a few large kernels
    optimizer = optax.flatten(optax.chain(optax.clip_by_global_norm(args.max_grad_norm),
                                          optax.adam(learning_rate, eps=1e-5)))
    return optimizer, lambda i: learning_rate(i * updates_per_iteration)


def update(graphdef, params, rest, optimizer, opt_state, batch: Batch, key, args: Args):
    """update_epochs passes of shuffled minibatch steps: (params, opt_state, mean metrics)."""

    def minibatch_step(state, minibatch):
        params, opt_state = state
        grads, metrics = jax.lax.pmean(jax.grad(ppo_loss, argnums=1, has_aux=True)(
            graphdef, params, rest, minibatch, args), args.env_axis)  # averaged over devices
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), metrics

    def epoch(state, permutation):
        minibatches = split_minibatches(batch, permutation, args.num_minibatches)
        return jax.lax.scan(minibatch_step, state, minibatches)

    def draw(key, _):  # in a loop of its own: see benchmarks/results/stress_jax0.10.2.md
        key, subkey = jax.random.split(key)
        return key, jax.random.permutation(subkey, args.local_envs)

    key = jax.random.fold_in(key, jax.lax.axis_index("envs")) if args.shard_envs else key
    permutations = jax.lax.scan(draw, key, length=args.update_epochs)[1]  # each device its own
    (params, opt_state), metrics = jax.lax.scan(epoch, (params, opt_state), permutations)
    return params, opt_state, jax.tree.map(jnp.mean, metrics)


# ====================================== Training loop ======================================
class TrainState(NamedTuple):  # one seed's training: all that a stopped run resumes from
    params: Any
    opt_state: Any
    runner: Runner
    iteration: jax.Array  # the iterations done
    update_key: jax.Array  # split into every iteration's key (see chunk)


def make_chunk(args: Args):
    """Pure functions of one seed: `init(key) -> TrainState`, and `chunk(state, n, size)`, which
    runs n <= size iterations on from `state`: (state, metrics [size], NaN past row n)."""
    args = check_args(args)
    env, env_params = make_env(args)
    optimizer, learning_rate = make_optimizer(args)

    def init(key) -> TrainState:
        # Philox: the default Threefry is a rolled loop on CPU, costly in per-step draws
        key = jax.random.key(jax.random.bits(key, dtype=jnp.uint32), impl="philox2x32")
        init_key, reset_key, runner_key, update_key = jax.random.split(key, 4)
        model = build_model(args, env, env_params, nnx.Rngs(init_key))
        carry = jax.tree.map(lambda x: this_device(x, args), model.initialize_state(args.num_envs))
        params = nnx.state(model, nnx.Param)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            this_device(jax.random.split(reset_key, args.num_envs), args), env_params)
        norm = init_norm(observe(obs, args), args)
        runner = Runner(env_state, observe(obs, args, norm), carry, jnp.zeros(args.local_envs),
                        jnp.zeros(args.local_envs, int), runner_key, norm)
        return TrainState(params, optimizer.init(params), runner, jnp.array(0), update_key)

    def iteration(graphdef, rest, update_keys, state: TrainState):
        params, opt_state, runner, i, _ = state
        update_key = update_keys[i]
        runner, t = rollout(graphdef, params, rest, env, env_params, runner, args)
        next_values = bootstrap_values(merge(graphdef, params, rest), t)
        advantages, returns = compute_gae(t, next_values, args)
        params, opt_state, metrics = update(graphdef, params, rest, optimizer, opt_state,
                                            rollout_batch(t, advantages, returns), update_key, args)
        total = lambda x: jax.lax.psum(x.sum(), args.env_axis)  # over all devices' envs
        variance = lambda x: moments(x.reshape(-1), args)[1]
        episodes = total(t.terminated | t.truncated)
        metrics.update({
            "charts/episodic_return": total(t.episode_return) / episodes,  # NaN: none ended
            "charts/episodic_length": total(t.episode_length) / episodes,
            "charts/learning_rate": learning_rate(i),
            "losses/explained_variance": jnp.where(  # NaN for constant returns, as CleanRL
                variance(returns) > 0,
                1.0 - variance(returns - t.output["value"]) / variance(returns), jnp.nan)})
        return TrainState(params, opt_state, runner, i + 1, state.update_key), metrics

    def chunk(state: TrainState, n, size: int):
        # the network's structure and its nnx.Rngs (read only by init); the Params are the state's
        graphdef, _, rest = nnx.split(build_model(args, env, env_params, nnx.Rngs(0)), nnx.Param,
                                      ...)
        # every iteration's key, split once for the whole run: chunks draw what one call draws
        step = functools.partial(iteration, graphdef, rest,
                                 jax.random.split(state.update_key, args.num_iterations))
        rows = jax.tree.map(lambda x: jnp.full((size,) + x.shape, jnp.nan, x.dtype),
                            jax.eval_shape(step, state)[1])

        def body(j, carry):
            state, metrics = step(carry[0])
            return state, jax.tree.map(lambda row, x: row.at[j].set(x), carry[1], metrics)

        return jax.lax.fori_loop(0, n, body, (state, rows))

    return init, chunk


def make_train(args: Args):
    """`train(key) -> (TrainState, metrics [num_iterations])`: the whole run as one pure function,
    for `jax.vmap` over keys; `main` runs the same iterations in chunks."""
    init, chunk = make_chunk(args)

    def train(key):
        return chunk(init(key), args.num_iterations, args.num_iterations)

    return train


def compile_run(args: Args):
    """The programs that train seeds args.seed .. args.seed + num_seeds - 1 (seed i of N trains as
    `--seed i` alone) on the devices: (init() -> state, chunk(state, n) -> (state, metrics
    [seed, chunk_size], NaN past n), compile seconds). A run that cannot fit in the devices'
    memory is refused here, before it trains."""
    init, chunk = make_chunk(args)
    mesh = jax.sharding.Mesh(np.reshape(devices(args), (1, -1) if args.shard_envs else (-1, 1)),
                             ("seeds", "envs"))
    seeds, per_env = P("seeds"), P("seeds", "envs")  # how the state is split over devices
    specs = TrainState(seeds, seeds, Runner(*[per_env] * 5, seeds, Norm(seeds, seeds, per_env)),
                       seeds, seeds)

    def over_seeds(f, per_seed, *shared):  # f of one seed, on the seeds of one device
        if len(jax.tree.leaves(per_seed)[0]) == 1:  # a vmap over one seed costs speed on CPU
            return jax.tree.map(lambda x: x[None], f(jax.tree.map(lambda x: x[0], per_seed),
                                                     *shared))
        return jax.vmap(f, in_axes=(0,) + (None,) * len(shared))(per_seed, *shared)

    def init_seeds(seed_index):
        return over_seeds(lambda index: init(jax.random.key(args.seed + index)), seed_index)

    def chunk_seeds(state, n):
        return over_seeds(functools.partial(chunk, size=args.chunk_size), state, n)

    if mesh.size > 1 or args.shard_envs:  # one device runs the plain program: it compiles faster
        # check_vma=False: gradients averaged by hand, as under pmap (with it, grad sums them)
        init_seeds = jax.shard_map(init_seeds, mesh=mesh, in_specs=seeds, out_specs=specs,
                                   check_vma=False)
        chunk_seeds = jax.shard_map(chunk_seeds, mesh=mesh, in_specs=(specs, P()),
                                    out_specs=(specs, seeds), check_vma=False)
    seed_index = jax.make_array_from_callback(  # on every host, the seeds of its own devices
        (args.num_seeds,), NamedSharding(mesh, seeds), lambda i: np.arange(args.num_seeds)[i])
    start = time.time()
    init_seeds = jax.jit(init_seeds).lower(seed_index).compile()
    chunk_seeds = jax.jit(  # the metrics replicated, for every host to read
        chunk_seeds, out_shardings=(None, NamedSharding(mesh, P()))).lower(
        init_seeds.out_info, args.chunk_size).compile()
    check_memory(args, chunk_seeds)
    return functools.partial(init_seeds, seed_index), chunk_seeds, time.time() - start


def check_memory(args: Args, compiled) -> None:
    """Refuse, naming the flags, a chunk program larger than its device's memory (XLA's count)."""
    stats, device = compiled.memory_analysis(), jax.local_devices()[0]
    need = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes)
    if device.platform == "cpu":  # every CPU device shares the host's memory
        need *= jax.local_device_count()
    have = free_memory(device)
    if need > have:
        raise ValueError(
            f"the run needs about {need / 2**30:.1f} GiB of memory and the {device.platform} has "
            f"{have / 2**30:.1f} GiB free: lower --num-envs {args.num_envs}, --num-steps "
            f"{args.num_steps} or --num-seeds {args.num_seeds}")


def free_memory(device) -> float:  # bytes that the device can still allocate
    if device.platform != "cpu":
        return (device.memory_stats() or {}).get("bytes_limit", math.inf)
    try:  # Linux: what can be allocated without swapping, the page cache included
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run(args: Args, program=None, start=None, on_chunk=None, repeats: int = 1):
    """Train in chunks of compiled iterations, from the start or from `start` = (state, metrics,
    iterations done) of a stopped run: (state, metrics [seed, iteration] with global_step,
    compile seconds, seconds of each of `repeats` runs). `program` is compile_run's.
    `on_chunk(state, metrics, done, seconds)` runs on the host after each chunk: False stops."""
    init, chunk, compile_s = program or compile_run(args)
    steps = args.batch_size * np.arange(1, args.num_iterations + 1, dtype=np.int64)  # no wrap
    train_s, waiter = [], concurrent.futures.ThreadPoolExecutor(1)
    for _ in range(repeats):
        begin = time.time()
        state, metrics, done = start or (init(), {}, 0)
        metrics = {"global_step": np.broadcast_to(steps, (args.num_seeds, len(steps))), **metrics}
        n = args.chunk_iterations or 1
        while done < args.num_iterations:
            n, called = min(n, args.num_iterations - done), time.time()
            state, rows = chunk(state, n)
            # waited for in a thread: the main thread then runs a signal's handler at once
            for k, v in waiter.submit(jax.device_get, rows).result().items():
                metrics.setdefault(k, np.full(metrics["global_step"].shape, np.nan, v.dtype))
                metrics[k][:, done:done + n] = v[:, :n]
            done += n
            if not args.chunk_iterations:  # about a second a call: each call costs a few ms
                n = max(1, min(args.chunk_size, round(n / max(time.time() - called, 1e-3))))
            if jax.process_count() > 1:  # every host runs the chunks that process 0 runs
                n = int(multihost_utils.broadcast_one_to_all(np.int32(n)))
            if on_chunk and on_chunk(state, metrics, done, time.time() - begin) is False:
                break
        jax.block_until_ready(state)
        train_s.append(time.time() - begin)
    return state, metrics, compile_s, train_s


# ================================ Evaluation and checkpoints ===============================
def evaluate(args: Args, params, norm) -> np.ndarray:
    """[seed, episode] returns of each seed's policy: an episode per env, the statistics frozen."""
    (env, env_params), n = make_env(args), args.eval_episodes or 10  # 10: for --eval-checkpoint

    def episodes(seed, params, norm):
        model_key, env_key, key = jax.random.split(jax.random.fold_in(jax.random.key(seed), 1), 3)
        model = build_model(args, env, env_params, nnx.Rngs(model_key))  # its Params replaced
        carry, (graphdef, _, rest) = model.initialize_state(n), nnx.split(model, nnx.Param, ...)
        obs, env_state = jax.vmap(lambda k: env.reset(k, env_params))(jax.random.split(env_key, n))

        def step(state):
            env_state, obs, carry, key, total, ended = state
            out = merge(graphdef, params, rest)(carry, observe(obs, args, norm))
            key, step_key = jax.random.split(key)
            obs, env_state, reward, terminated, truncated, _ = jax.vmap(
                env.step, in_axes=(0, 0, 0, None))(jax.random.split(step_key, n), env_state,
                out.output["mode" if args.eval_deterministic else "action"], env_params)
            return (env_state, obs, out.next_state, key, total + jnp.where(ended, 0.0, reward),
                    ended | terminated | truncated)

        state = (env_state, obs, carry, key, jnp.zeros(n), jnp.zeros(n, bool))
        return jax.lax.while_loop(lambda state: ~state[-1].all(), step, state)[-2]

    return np.asarray(jax.jit(jax.vmap(episodes))(jnp.array(args.seeds), params, norm))


def refuse_changes(cli: Args, flag: str, allowed: tuple) -> None:
    """--eval-checkpoint and --resume take the saved run's flags: only `allowed` may be given."""
    for name in [k for k, v in vars(cli).items() if v != getattr(Args, k) and k not in allowed]:
        flags = ", ".join(f"--{k}" for k in allowed).replace("_", "-")
        raise ValueError(f"--{name.replace('_', '-')} cannot change the run saved at "
                         f"{getattr(cli, flag)}: only {flags} apply to it")


def load_run(cli: Args):
    """(Args, params, norm) of the run saved at --eval-checkpoint, seeds stacked."""
    check_args(cli)  # the flags given, before the saved ones
    path = cli.eval_checkpoint
    ok = ("eval_checkpoint", "eval_episodes", "eval_deterministic", "track", "wandb_project_name",
          "wandb_entity")  # this evaluation's own flags
    refuse_changes(cli, "eval_checkpoint", ok)
    if os.path.isdir(path) and not glob.glob(os.path.join(glob.escape(path), "seed_*")):
        folder = os.path.normpath(path)
        raise ValueError(f"--eval-checkpoint {path} holds no seed_* model: " + (
            f"it is one seed's; give its run folder, {os.path.dirname(folder)}"
            if os.path.basename(folder).startswith("seed_") else
            f"it is a stopped run; --resume {path} finishes it"
            if os.path.isdir(os.path.join(path, "state")) else
            "give a folder runs/{run_name} that --save-model wrote"))
    read = lambda entry, **items: ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
        os.path.abspath(os.path.join(path, entry)), args=ocp.args.Composite(**items))
    try:  # each seed's entry holds the Args; params go into the shapes of nnx.eval_shape's model
        saved = read(next(e for e in sorted(os.listdir(path)) if e.startswith("seed_")),
                     args=ocp.args.JsonRestore())["args"]
        if saved["script"] != os.path.basename(__file__):
            raise ValueError(f"{saved['script']} saved it: evaluate it with that script")
        args = check_args(Args(**{**saved["args"], "save_model": False, **{
            k: getattr(cli, k) for k in ok}}))
        model = nnx.eval_shape(lambda: build_model(args, *make_env(args), nnx.Rngs(0)))
        runs = [read(f"seed_{seed}", params=ocp.args.StandardRestore(nnx.state(model, nnx.Param)),
                     norm=ocp.args.StandardRestore()) for seed in args.seeds]  # norm: as dicts
        return (args, *jax.tree.map(lambda *x: jnp.stack(x),
                                    *[(run["params"], Norm(**run["norm"])) for run in runs]))
    except Exception as error:  # missing, corrupt, another script's
        raise ValueError(f"--eval-checkpoint {path} is not a run saved by "
                         f"{os.path.basename(__file__)} ({error!r:.200})") from None


def reserve_run_dir(args: Args, stamp: int) -> tuple[str, int]:
    """Create runs/{env_id}__{exp_name}__{seed}__{stamp} before anything compiles, with the next
    free stamp if it is taken (runs started in the same second), and prove it writable."""
    def run_dir(stamp: int) -> str:  # CleanRL's run name
        return f"runs/{args.env_id}__{args.exp_name}__{args.seed}__{stamp}"

    error = ""
    if jax.process_index() == 0:  # on a shared file system, one host reserves for all
        try:
            os.makedirs("runs", exist_ok=True)
            while not try_mkdir(run_dir(stamp)):
                stamp += 1
            tempfile.TemporaryFile(dir=run_dir(stamp)).close()
        except OSError as err:
            error, stamp = f"{err.strerror}: {err.filename}", -1
    if jax.process_count() > 1:
        stamp = int(multihost_utils.broadcast_one_to_all(np.int32(stamp)))
    if stamp < 0:
        raise ValueError(f"cannot write the run folder in {os.path.abspath('runs')} ("
                         f"{error or 'on process 0'}): start the run where runs/ can be written")
    return run_dir(stamp), stamp


def try_mkdir(path: str) -> bool:  # False if it exists: mkdir is atomic, exists-then-mkdir is not
    try:
        os.mkdir(path)
        return True
    except FileExistsError:
        return False


def checkpoints(run_dir: str) -> ocp.CheckpointManager:
    """runs/{run_name}/state/{iteration}: the newest training state only. Orbax writes a step to a
    temporary folder and renames it when complete, so a kill mid-write keeps the one before."""
    return ocp.CheckpointManager(os.path.abspath(os.path.join(run_dir, "state")),
                                 options=ocp.CheckpointManagerOptions(
                                     max_to_keep=1, enable_async_checkpointing=False))


def save_state(run_dir: str, state: TrainState, metrics: dict, done: int, meta: dict) -> None:
    """The whole training state after `done` iterations, every iteration's metrics so far, and
    `meta` (the Args, the W&B run ids): what --resume continues from."""
    with checkpoints(run_dir) as manager:
        if manager.latest_step() != done:
            manager.save(done, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                history=ocp.args.StandardSave({k: v for k, v in metrics.items()
                                               if k != "global_step"})))


def load_stopped(cli: Args) -> tuple[Args, dict]:
    """(Args, meta) of the stopped run at --resume; meta["done"]: the iterations it ran."""
    check_args(cli)
    path = cli.resume
    ok = ("resume", "save_model", "save_every", "chunk_iterations", "eval_episodes",
          "eval_deterministic")  # flags that leave the run's numbers alone
    refuse_changes(cli, "resume", ok)
    if not os.path.isdir(os.path.join(path, "state")):
        raise ValueError(f"--resume {path} holds no training state (a state/ folder): give a "
                         "runs/{run_name} that a stopped run or --save-every saved")
    try:
        with checkpoints(path) as manager:
            done = manager.latest_step()
            meta = manager.restore(done, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = dict(meta["meta"], done=done)
        if meta["script"] != os.path.basename(__file__):
            raise ValueError(f"{meta['script']} saved it: resume it with that script")
        args = check_args(Args(**{**meta["args"], **{k: getattr(cli, k) for k in ok[1:]}}))
    except Exception as error:  # missing, corrupt, another script's
        raise ValueError(f"--resume {path} is not a run saved by {os.path.basename(__file__)} "
                         f"({error!r:.200})") from None
    if done == args.num_iterations:
        raise ValueError(f"--resume {path}: the run has finished; --eval-checkpoint {path} "
                         "evaluates it")
    return args, meta


def restore_state(run_dir: str, done: int, like: TrainState) -> tuple[TrainState, dict, int]:
    """The state saved after `done` iterations, placed on the devices as `like`, and the metrics."""
    with checkpoints(run_dir) as manager:
        saved = manager.restore(done, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(like), history=ocp.args.StandardRestore()))
    return saved["state"], {k: np.array(v) for k, v in saved["history"].items()}, done


def save_model(folder: str, args: Args, params, norm) -> None:
    """An Orbax checkpoint per seed, seed_{seed}: its params and statistics, and the Args."""
    for i, seed in enumerate(args.seeds):
        ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(
            os.path.abspath(f"{folder}/seed_{seed}"), args=ocp.args.Composite(
                params=ocp.args.StandardSave(jax.tree.map(lambda x: x[i], params)),
                norm=ocp.args.StandardSave(jax.tree.map(lambda x: x[i], norm)),
                args=ocp.args.JsonSave(dict(script=os.path.basename(__file__),
                                            args=dataclasses.asdict(args)))))


def keep(run_dir: str, what: str, write) -> tuple[Optional[str], str]:
    """write(folder) into the run folder or, failing that (a full disk), a temporary folder:
    (the folder, or None if both failed; one line saying where, or what was lost and why)."""
    errors = []
    for folder in (run_dir, f"{tempfile.gettempdir()}/{os.path.basename(run_dir)}"):
        try:
            os.makedirs(folder, exist_ok=True)
            with quiet():
                write(folder)
            return folder, f"saved {what}: {folder}" + (f" (not {'; '.join(errors)})"
                                                          if errors else "")
        except Exception as error:  # OSError, or Orbax's own on a full disk
            errors.append(f"{folder}: {str(error).splitlines()[0][:160] or repr(error)}")
            for partial in glob.glob(f"{glob.escape(folder)}/**/*.orbax-checkpoint-tmp*",
                                     recursive=True):
                shutil.rmtree(partial, ignore_errors=True)  # Orbax's half-written folders
    return None, f"could not save {what}, lost: " + "; ".join(errors)


@contextlib.contextmanager
def quiet():  # Orbax's threads print a failed write's tracebacks: keep them off the console
    console, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(console, 2)
        os.close(console)
        os.close(devnull)


# ========================================== Main ===========================================
def final_return(metrics: dict) -> np.ndarray:
    """Mean episodic return over the last 5% of iterations, per seed (NaN if none ended)."""
    last = np.asarray(metrics["charts/episodic_return"])
    last = last[..., -max(1, last.shape[-1] // 20):]
    ended = (~np.isnan(last)).sum(-1)
    return np.where(ended > 0, np.nansum(last, -1) / np.maximum(ended, 1), np.nan)


def first_nonfinite(args: Args, metrics: dict, params=None) -> Optional[str]:
    """Where a run first went NaN or infinite: in the losses of the iterations in `metrics`, else
    in the final `params`."""
    names = [k for k in metrics if k.startswith("losses/") and k != "losses/explained_variance"]
    bad = np.stack([~np.isfinite(np.asarray(metrics[k])) for k in names], -1)  # [seed, i, name]
    bad_params = np.any([~np.isfinite(x.reshape(len(x), -1)).all(-1)
                         for x in jax.tree.leaves(params)], axis=0)  # [seed]
    if bad.any():
        seed, i, k = min(zip(*np.nonzero(bad)), key=lambda sik: sik[1:])
        what = f"{names[k]} is {float(metrics[names[k]][seed, i])}"
    elif bad_params.any():
        seed, i, what = bad_params.argmax(), args.num_iterations - 1, "the weights are not finite"
    else:
        return None
    return (f"seed {args.seed + seed}: {what} at iteration {i + 1} of {args.num_iterations} "
            f"(global_step {(i + 1) * args.batch_size}); the run diverged")


def init_wandb(args: Args, stamp: int, ids=None) -> list:
    """A W&B run per seed, named the CleanRL way (or, resuming, the runs `ids`); offline without
    credentials or a server."""
    import wandb

    def offline(why: str) -> str:
        print(f"notice: --track {why}; logging offline to ./wandb, `wandb sync` uploads it later",
              file=sys.stderr)
        return "offline"

    mode, runs = None, []  # None: W&B's choice (WANDB_MODE, else online)
    if (os.environ.get("WANDB_MODE") not in ("offline", "disabled")
            and not wandb.login(prompt=False, verify=False)):
        mode = offline("found no W&B credentials (`wandb login` or WANDB_API_KEY)")
    for i, seed in enumerate(args.seeds):
        settings = dict(project=args.wandb_project_name, entity=args.wandb_entity, save_code=True,
                        name=f"{args.env_id}__{args.exp_name}__{seed}__{stamp}",
                        group=f"{args.env_id}__{args.exp_name}__{stamp}", reinit="create_new",
                        config={**dataclasses.asdict(args), "seed": seed},
                        id=ids[i] if ids else None, resume="allow" if ids else None)
        try:
            run = wandb.init(mode=mode, **settings)
        except wandb.errors.Error as error:  # no network, or a key the server rejects
            mode = offline(f"could not reach W&B ({str(error).splitlines()[0]})")
            run = wandb.init(mode=mode, **settings)
        run.define_metric("*", step_metric="global_step")
        runs.append(run)
    return runs


def progress(args: Args, metrics: dict, done: int, first: int, seconds: float) -> str:
    """The console line after `done` iterations, `seconds` after resuming from `first`."""
    step, total = done * args.batch_size, args.num_iterations * args.batch_size
    returns = metrics["charts/episodic_return"][:, :done]
    last = np.where(np.isnan(returns), -1, np.arange(done)).max(-1)  # an episode ended there
    latest = np.where(last >= 0, returns[np.arange(len(returns)), last], np.nan)
    return (f"global_step={step:>9d} ({step / total:4.0%}, "
            f"{seconds * (args.num_iterations - done) / (done - first):.0f} s left)  "
            f"episodic_return={' '.join(f'{r:.1f}' for r in latest)}  "
            f"SPS={(done - first) * args.batch_size * args.num_seeds / seconds:,.0f}")


def main(args: Args) -> None:
    stamp, script, reserved, meta = int(time.time()), os.path.basename(__file__), None, {}
    if jax.process_index():  # only process 0 prints and logs
        sys.stdout = open(os.devnull, "w")
    try:  # what can be refused before training is, in one line with exit code 2
        if args.eval_checkpoint:
            args, *saved = load_run(args)
        elif args.resume:
            run_dir, (args, meta) = args.resume, load_stopped(args)
            stamp = meta["stamp"]
        else:
            args = check_args(args)
            run_dir, stamp = reserve_run_dir(args, stamp)
            reserved = jax.process_index() == 0  # the host that made the folder
        program = None if args.eval_checkpoint else compile_run(args)
    except ValueError as error:
        if reserved:
            os.rmdir(run_dir)  # empty: this run made it
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    wandb_runs = (init_wandb(args, stamp, meta.get("wandb_ids"))
                  if args.track and jax.process_index() == 0 else [])
    failure, stopped, exit_code = None, False, 0
    if not args.eval_checkpoint:
        first = meta.get("done", 0)  # iterations run before a resume
        start = restore_state(run_dir, first, program[0]()) if first else None
        meta = dict(script=script, args=dataclasses.asdict(args), stamp=stamp,
                    wandb_ids=meta.get("wandb_ids") or [run.id for run in wandb_runs])
        signals, logged, printed, saved_at = [], first, 0.0, first

        def on_signal(signum, frame):  # stop at the end of the chunk under way
            signals.append(signum)
            for s in (signal.SIGINT, signal.SIGTERM):  # a second one stops at once
                signal.signal(s, signal.SIG_DFL)

        def after_chunk(state, metrics, done, seconds):  # on the host, between compiled chunks
            nonlocal failure, logged, printed, saved_at
            for i in range(logged, done):  # W&B: every iteration
                for seed_index, wandb_run in enumerate(wandb_runs):
                    wandb_run.log({k: v[seed_index, i].item() for k, v in metrics.items()})
            logged = done
            if time.time() - printed >= 1 or done == args.num_iterations:  # a line a second
                printed = time.time()
                print(progress(args, metrics, done, first, seconds), flush=True)
            failure = first_nonfinite(args, {k: v[:, :done] for k, v in metrics.items()})
            if args.save_every and done - saved_at >= args.save_every and not failure:
                folder, line = keep(run_dir, "the training state",
                                    lambda folder: save_state(folder, state, metrics, done, meta))
                saved_at = done if folder else saved_at
                print(line if folder else f"warning: {line}", file=sys.stdout if folder
                      else sys.stderr, flush=True)
            stop = bool(signals)
            if jax.process_count() > 1:  # a signal to any host stops all of them
                stop = bool(multihost_utils.process_allgather(np.int32(stop)).max())
            return not (failure or stop)

        handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            state, metrics, compile_s, (train_s,) = run(args, program, start, after_chunk)
        finally:
            for s, handler in handlers.items():
                signal.signal(s, handler)
        done = logged
        if signals and not failure and done < args.num_iterations:  # keep this boundary
            folder, line = keep(run_dir, "the training state",
                                lambda folder: save_state(folder, state, metrics, done, meta))
            print(f"stopped by {signal.Signals(signals[0]).name} at iteration {done} of "
                  f"{args.num_iterations}; {line}"
                  + (f"; resume with: python {script} --resume {folder}" if folder else ""),
                  file=sys.stderr)
            stopped, exit_code = True, 128 + signals[0]
        else:
            metrics = {k: v[:, :done] for k, v in metrics.items()}
            saved = jax.tree.map(np.asarray, multihost_utils.process_allgather(
                (state.params, state.runner.norm), tiled=True))  # every seed, on every host
            failure = failure or first_nonfinite(args, metrics, saved[0])
            finals, steps = final_return(metrics), (done - first) * args.batch_size * args.num_seeds
            for wandb_run, final in zip(wandb_runs, finals):
                wandb_run.summary["final_episodic_return"] = float(final)
            print(f"summary: env={args.env_id} seeds={list(args.seeds)} "
                  f"final_episodic_return={[round(float(r), 2) for r in finals]} "
                  f"env_steps={steps} compile_s={compile_s:.1f} train_s={train_s:.1f} "
                  f"SPS={steps / train_s:,.0f}")
    if args.save_model and not (failure or stopped):
        def save(folder):  # each seed's model, and the state with every iteration's metrics
            save_model(folder, args, *saved)
            save_state(folder, state, metrics, done, meta)

        folder, line = keep(run_dir, "the model", save)
        print(line if folder else f"error: {line}", file=sys.stdout if folder else sys.stderr)
        exit_code = 0 if folder else 1
    if (args.eval_episodes or args.eval_checkpoint) and not (failure or stopped):
        returns = evaluate(args, *saved)
        for wandb_run, r in zip(wandb_runs, returns):
            wandb_run.log({"eval/episodic_return": r.mean(), "eval/episodic_return_std": r.std()})
        print(f"eval: {returns.shape[1]} episodes, deterministic={args.eval_deterministic}, "
              "eval/episodic_return=" + " ".join(f"{r.mean():.2f}+-{r.std():.2f}" for r in returns))
    exit_code = 1 if failure else exit_code
    for wandb_run in wandb_runs:
        wandb_run.finish(exit_code=exit_code)
    if reserved and not os.listdir(run_dir):
        os.rmdir(run_dir)  # nothing was kept in it
    if failure:
        print(f"error: {failure}", file=sys.stderr)
    if exit_code:
        sys.exit(exit_code)


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except KeyboardInterrupt:  # while compiling, saving or evaluating: training has its handler
        print("stopped by SIGINT outside training; what was saved is kept", file=sys.stderr)
        sys.exit(130)
