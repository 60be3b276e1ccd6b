"""PPO for gymnax with a Flax NNX actor-critic, in one file, with loss replay that is exact.

    python ppo_nnx.py --env-id CartPole-v1

The loss replay recomputes the rollout's outputs from stored data; before the first gradient step
the two must agree, or PPO's ratio is wrong from the start. They agree even through random layers:
every draw comes from a per-env key in the network's carry, stored and sliced with the data, and
every sampled action is stored in `rollout_extras` and re-scored, never re-sampled.

The algorithm is one device's program for one seed; `compile_run` places seeds and envs on
devices, and the compiler inserts what they exchange.
"""

import concurrent.futures
import contextlib
import dataclasses
import functools
import glob
import importlib
import itertools
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Literal, NamedTuple, Optional

import jax

# many hosts: jax.distributed starts before gymnax, whose import starts jax's backend;
# unset numbers are found from SLURM's or Open MPI's variables
if "JAX_COORDINATOR_ADDRESS" in os.environ:
    count, index = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
    jax.distributed.initialize(
        num_processes=count and int(count), process_id=index and int(index)
    )
import gymnax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import tyro
from flax import nnx
from gymnax.environments import spaces
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


# ======================================== Arguments ========================================
@dataclasses.dataclass
class Args:
    # tyro reads each field's trailing comment as its --help: kept on one line
    # fmt: off
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # the name of this experiment
    seed: int = 1  # seed of the experiment (with --num-seeds N: seed .. seed+N-1)
    track: bool = False  # if toggled, this experiment will be tracked with Weights and Biases
    wandb_project_name: str = "ppo-nnx"  # the wandb's project name
    wandb_entity: Optional[str] = None  # the entity (team) of wandb's project
    env_id: str = "CartPole-v1"  # a gymnax id, or package.module:Class of an env with its API
    mask_velocity: bool = False  # hide velocities (CartPole-v1, Pendulum-v1): needs memory
    total_timesteps: int = 500_000  # total env steps of the experiment (per seed)
    learning_rate: float = 2.5e-4  # the learning rate of the optimizer
    num_envs: int = 4  # the number of parallel game environments
    num_steps: int = 128  # the number of steps to run in each environment per policy rollout
    anneal_lr: bool = True  # toggle learning rate annealing for policy and value networks
    gamma: float = 0.99  # the discount factor gamma
    gae_lambda: float = 0.95  # the lambda for the general advantage estimation
    num_minibatches: int = 4  # the number of mini-batches
    update_epochs: int = 4  # the K epochs to update the policy
    norm_adv: bool = True  # toggles advantages normalization
    clip_coef: float = 0.2  # the surrogate clipping coefficient
    clip_vloss: bool = True  # toggles whether or not to use a clipped loss for the value function
    ent_coef: float = 0.01  # coefficient of the entropy
    vf_coef: float = 0.5  # coefficient of the value function
    max_grad_norm: float = 0.5  # the maximum norm for the gradient clipping
    num_seeds: int = 1  # seeds trained at once by jax.vmap, in one compiled program, over devices
    shard_envs: bool = False  # one agent per seed, its envs split over all devices (data parallel)
    sweep: tuple[str, ...] = ()  # a grid trained at once, e.g. gamma=0.9,0.99 ent-coef=0,0.01
    hidden_size: int = 64  # width of the hidden layers
    activation: Literal["tanh", "relu"] = "tanh"  # the hidden layers' nonlinearity (CleanRL: tanh)
    encoder: Literal["mlp", "conv"] = "mlp"  # conv: a small CNN first, for images [H, W, C]
    latent_size: int = 0  # size of the VariationalBottleneck in the actor (0 = no bottleneck)
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
    # fmt: on

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_iterations(self) -> int:
        return self.total_timesteps // self.batch_size

    @property
    def seeds(self) -> range:
        return range(self.seed, self.seed + self.num_seeds)

    @property
    def configs(self) -> list[dict]:  # the --sweep grid ([{}] without)
        return sweep_grid(self.sweep)

    @property
    def members(self) -> list[tuple[dict, int]]:
        """(configuration, seed) of each run trained at once, the seeds varying fastest."""
        return [(config, seed) for config in self.configs for seed in self.seeds]

    @property
    def chunk_size(self) -> int:  # the most iterations one compiled call runs
        return self.chunk_iterations or min(self.num_iterations, 1000)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# what --sweep may vary: values that change no array shape and no branch of the program
SWEEPABLE = (
    "learning_rate gamma gae_lambda clip_coef ent_coef vf_coef max_grad_norm kl_coef"
)


def sweep_grid(sweep: tuple) -> list[dict]:
    """Every combination of the values --sweep lists, as {field: value}."""
    axes = {}
    for item in sweep:
        name, _, values = item.partition("=")
        field = name.removeprefix("--").replace("-", "_")
        if field not in SWEEPABLE.split():
            why = "shapes the program" if hasattr(Args, field) else "no such flag"
            allowed = SWEEPABLE.replace("_", "-")
            raise ValueError(f"--sweep {name}: {why}; sweepable: {allowed}")
        if field in axes:
            raise ValueError(f"--sweep names {name} twice")
        try:
            axes[field] = [float(value) for value in values.split(",")]
        except ValueError:
            raise ValueError(f"--sweep {item}: give {name}=number,number,...") from None
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def config_name(config: dict) -> str:
    """A --sweep configuration as it was given, e.g. learning-rate=0.001,ent-coef=0."""
    return ",".join(f"{flag(field)[2:]}={value:g}" for field, value in config.items())


def check_args(args: Args) -> Args:
    """Reject, naming the flag, what would fail deep in JAX or train silently wrong; fill Nones."""
    counts = (
        "total_timesteps num_envs num_steps num_minibatches update_epochs num_seeds"
    )
    coefs = "learning_rate clip_coef ent_coef vf_coef max_grad_norm kl_coef"
    optional = "latent_size eval_episodes save_every chunk_iterations"
    for names, low, high, rule in [
        (f"{counts} hidden_size", 1, math.inf, "> 0"),
        (f"{coefs} {optional}", 0, math.inf, ">= 0"),
        ("gamma gae_lambda", 0, 1, "in [0, 1]"),
    ]:
        for name in names.split():
            values = [config.get(name, getattr(args, name)) for config in args.configs]
            wrong = [value for value in values if not low <= value <= high]  # NaN too
            if wrong:
                raise ValueError(f"{flag(name)} must be {rule}, got {wrong[0]}")
    if "kl_coef" in args.configs[0] and not args.latent_size:
        raise ValueError("--sweep kl-coef: there is no bottleneck (--latent-size 0)")
    if args.activation not in ACTIVATIONS:
        choices = ", ".join(ACTIVATIONS)
        raise ValueError(
            f"--activation must be one of {choices}, got {args.activation!r}"
        )
    if args.total_timesteps < args.batch_size:
        raise ValueError(
            f"--total-timesteps {args.total_timesteps} is below one batch "
            f"(--num-envs * --num-steps = {args.batch_size})"
        )
    if args.batch_size % args.num_minibatches:
        raise ValueError(
            f"--num-minibatches {args.num_minibatches} must divide --num-envs x "
            f"--num-steps, {args.num_envs} x {args.num_steps}"
        )
    if args.norm_adv and args.batch_size // args.num_minibatches < 2:
        raise ValueError(
            f"--num-minibatches {args.num_minibatches} leaves one sample per minibatch, "
            "whose normalized advantage is 0: use fewer, or --no-norm-adv"
        )
    updates = args.num_iterations * args.update_epochs * args.num_minibatches
    if updates >= 2**31:  # optax counts them in int32
        raise ValueError(
            f"--total-timesteps {args.total_timesteps} makes {updates:,} gradient steps, "
            f"above the {2**31 - 1:,} that optax can count"
        )
    if not -(2**31) <= args.seed <= 2**31 - args.num_seeds:  # JAX seeds are int32
        raise ValueError(f"--seed {args.seed} must be in [-2**31, 2**31 - --num-seeds]")
    if (
        args.exp_name in ("", ".", "..")
        or os.path.basename(args.exp_name) != args.exp_name
    ):
        raise ValueError(
            f"--exp-name {args.exp_name!r} must be a plain name: it names a folder in runs/"
        )
    if args.resume and args.eval_checkpoint:
        raise ValueError(
            "--resume trains and --eval-checkpoint does not: give one of them"
        )
    # a saved run was placed when it trained
    if not (args.eval_checkpoint or args.resume):
        devices(args)
    env, env_params = make_env(args)
    shape = env.observation_space(env_params).shape
    if args.encoder == "conv" and len(shape) != 3:
        raise ValueError(
            f"--encoder conv needs image observations [H, W, C]; {args.env_id}'s are {shape}"
        )
    continuous = not isinstance(env.action_space(env_params), spaces.Discrete)
    return dataclasses.replace(
        args,
        norm_obs=continuous if args.norm_obs is None else args.norm_obs,
        norm_reward=continuous if args.norm_reward is None else args.norm_reward,
    )


# ========================================= Modules =========================================
class Output(NamedTuple):
    next_state: Any  # the carry for the next step, [B, ...]
    output: Any  # what the caller consumes
    regularization_loss: jax.Array  # [B], added to the PPO loss
    metrics: dict = {}  # scalars worth logging (never written to)
    rollout_extras: Any = ()  # what replay needs to reproduce this call


class StatefulModule(nnx.Module):
    """Per-env state travels in an explicit carry, [B, ...], not in NNX variables.

    `__call__(carry, x, rollout_extras=None) -> Output` samples afresh and emits `rollout_extras`
    when given None (rollout, inference), and consumes the stored ones (loss replay). Write rule:
    it never writes a variable that shapes its output. A container names its stateful children in
    `stateful`; its carry holds an entry for each.
    """

    stateful: tuple = ()

    def initialize_state(self, batch_size: int) -> Any:
        return {
            name: getattr(self, name).initialize_state(batch_size)
            for name in self.stateful
        }

    def reset_state(self, carry: Any) -> Any:
        """The carry of an env whose episode just ended."""
        return {
            name: getattr(self, name).reset_state(carry[name]) for name in self.stateful
        }


def carry_after_step(module: StatefulModule, next_state: Any, done: jax.Array) -> Any:
    """The next step's carry: reset in the envs whose episode ended (`done`, [B])."""

    def select(reset, kept):
        done_rows = done.reshape(done.shape + (1,) * (kept.ndim - 1))
        return jnp.where(done_rows, reset, kept)

    return jax.tree.map(select, module.reset_state(next_state), next_state)


def flatten_steps(tree):  # [T, B, ...] -> [T * B, ...]
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tree)


def split_per_env(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(next keys, keys to use)."""
    next_keys, use_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    return next_keys, use_keys


def normal_per_env(keys: jax.Array, like: jax.Array) -> jax.Array:
    """Row b from keys[b] alone."""
    noise = jax.vmap(functools.partial(jax.random.normal, shape=like.shape[1:]))(keys)
    # drawn once: XLA copied it into each consumer
    return jax.lax.optimization_barrier(noise)


class KeyCarryModule(StatefulModule):
    """A random module whose carry is one PRNG key per env, [B], split on every call: stored and
    sliced with the data, the keys give replay the rollout's draws in any minibatch. `self.rngs`
    only seeds them (drawn from in `__call__`, it gives replay other noise). Resets keep them."""

    def __init__(self, rngs: nnx.Rngs):
        self.rngs = rngs

    def initialize_state(self, batch_size: int) -> jax.Array:
        return jax.random.split(self.rngs(), batch_size)

    def reset_state(self, carry: jax.Array) -> jax.Array:
        return carry


ACTIVATIONS = {"tanh": jnp.tanh, "relu": jax.nn.relu}  # --activation


def mlp(
    sizes: list[int], out_scale: float, activation, rngs: nnx.Rngs
) -> nnx.Sequential:
    """Linear layers from sizes[0] to sizes[-1], `activation` after each but the last, with
    CleanRL's orthogonal initialization (the last layer's scale: `out_scale`)."""
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        last = i == len(sizes) - 2
        kernel_init = nnx.initializers.orthogonal(out_scale if last else math.sqrt(2))
        layers.append(nnx.Linear(n_in, n_out, kernel_init=kernel_init, rngs=rngs))
        if not last:
            layers.append(activation)
    return nnx.Sequential(*layers)


def patches(x: jax.Array, stride: int) -> jax.Array:
    """[..., H, W, C] -> [..., H', W', 9 C]: the 3x3 neighbourhood of every `stride`-th pixel,
    zero-padded as SAME. A 3x3 convolution is then a matrix product, which XLA runs fast on a
    CPU inside loops, where its own convolutions run several times slower."""
    height, width = x.shape[-3:-1]
    out_h, out_w = math.ceil(height / stride), math.ceil(width / stride)
    pad_h, pad_w = (out_h - 1) * stride + 3 - height, (out_w - 1) * stride + 3 - width
    pads = [(pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0)]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 3) + pads)
    rows, cols = (out_h - 1) * stride + 1, (out_w - 1) * stride + 1
    shifted = [
        x[..., i : i + rows : stride, j : j + cols : stride, :]
        for i in range(3)
        for j in range(3)
    ]
    return jnp.concatenate(shifted, axis=-1)


class ConvEncoder(nnx.Module):
    """--encoder conv: images [..., H, W, C] to features [..., size], through two 3x3
    convolutions with ReLU (16 channels, then 32 at stride 2), a small CNN as for MinAtar."""

    def __init__(self, shape: tuple, rngs: nnx.Rngs):
        height, width, channels = shape
        orthogonal = nnx.initializers.orthogonal(math.sqrt(2))  # as mlp's hidden layers
        self.conv1 = nnx.Linear(9 * channels, 16, kernel_init=orthogonal, rngs=rngs)
        self.conv2 = nnx.Linear(9 * 16, 32, kernel_init=orthogonal, rngs=rngs)
        self.size = math.ceil(height / 2) * math.ceil(width / 2) * 32

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.conv1(patches(x, 1)))
        x = jax.nn.relu(self.conv2(patches(x, 2)))
        return x.reshape(x.shape[:-3] + (-1,))


class VariationalBottleneck(KeyCarryModule):
    """z = mean + std * eps, eps from the per-env key, with the KL to N(0, I) as a loss."""

    def __init__(self, in_size: int, latent_size: int, kl_coef: float, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.mean = nnx.Linear(in_size, latent_size, rngs=rngs)
        self.pre_std = nnx.Linear(in_size, latent_size, rngs=rngs)
        # data, not a constant of the graph: --sweep traces it
        self.kl_coef = nnx.data(jnp.asarray(kl_coef))

    def __call__(self, key, x, rollout_extras=None):
        next_key, noise_key = split_per_env(key)
        mean = self.mean(x)
        std = jax.nn.softplus(self.pre_std(x)) + 1e-6
        kl = 0.5 * jnp.sum(mean**2 + std**2 - 1.0 - 2.0 * jnp.log(std), axis=-1)
        return Output(
            next_state=next_key,
            output=mean + std * normal_per_env(noise_key, mean),
            regularization_loss=self.kl_coef * kl,
            metrics={"losses/kl": kl.mean()},
        )


class CategoricalSampler(KeyCarryModule):
    """A discrete action from logits; replay re-scores the stored action."""

    def __call__(self, key, logits, rollout_extras=None):
        next_key, sample_key = split_per_env(key)
        if rollout_extras is None:
            action = jax.vmap(jax.random.categorical)(sample_key, logits)
        else:
            action = rollout_extras
        log_probs = jax.nn.log_softmax(logits)
        # a one-hot product, not an index: its gradient avoids a slow scatter on CPU
        log_prob = jnp.sum(
            jax.nn.one_hot(action, logits.shape[-1]) * log_probs, axis=-1
        )
        entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
        return Output(
            next_state=next_key,
            output=dict(
                action=action,
                log_prob=log_prob,
                entropy=entropy,
                mode=logits.argmax(-1),
            ),
            regularization_loss=jnp.zeros_like(log_prob),
            rollout_extras=action,
        )


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
        if rollout_extras is None:
            raw = mean + std * normal_per_env(sample_key, mean)
        else:
            raw = rollout_extras
        log_density = (
            -0.5 * ((raw - mean) / std) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
        )
        log_prob = jnp.sum(log_density, axis=-1)
        entropy = jnp.sum(0.5 + 0.5 * math.log(2 * math.pi) + log_std)
        low, high = jnp.asarray(self.low), jnp.asarray(self.high)
        return Output(
            next_state=next_key,
            output=dict(
                action=jnp.clip(raw, low, high),
                log_prob=log_prob,
                entropy=jnp.broadcast_to(entropy, log_prob.shape),
                mode=jnp.clip(mean, low, high),
            ),
            regularization_loss=jnp.zeros_like(log_prob),
            rollout_extras=raw,
        )


class ActorCritic(StatefulModule):
    """CleanRL's separate actor and critic MLPs, optionally a bottleneck in the actor; with
    --encoder conv, one CNN in front of both, as in CleanRL's Atari PPO."""

    def __init__(
        self, obs_shape: tuple, action_head: int, sampler, args: Args, rngs: nnx.Rngs
    ):
        h, activation = args.hidden_size, ACTIVATIONS[args.activation]
        self.conv = None  # built only if asked: its init draws from rngs
        obs_size = obs_shape[-1]
        if args.encoder == "conv":
            self.conv = nnx.data(ConvEncoder(obs_shape, rngs))
            obs_size = self.conv.size
        torso = mlp([obs_size, h, h], math.sqrt(2), activation, rngs)
        # the torso's features come activated, as the hidden layers' do
        self.actor_torso = nnx.Sequential(*torso.layers, activation)
        features = args.latent_size or h
        self.bottleneck = None  # built only if asked: its init draws from rngs
        if args.latent_size:
            self.bottleneck = nnx.data(
                VariationalBottleneck(h, args.latent_size, args.kl_coef, rngs)
            )
        self.actor_head = mlp([features, action_head], 0.01, activation, rngs)
        self.sampler = sampler
        self.critic = mlp([obs_size, h, h, 1], 1.0, activation, rngs)
        stateful = ("bottleneck", "sampler")
        self.stateful = stateful if args.latent_size else ("sampler",)

    def features(self, obs: jax.Array) -> jax.Array:
        """What the MLPs read: the observation, through the CNN if there is one."""
        return obs if self.conv is None else self.conv(obs)

    def value(self, obs: jax.Array) -> jax.Array:  # V(obs), [B]
        return self.critic(self.features(obs))[..., 0]

    def child(self, name: str, carry, x, extras: dict):
        """Child `name`'s step, on its own part of the carry and of the extras."""
        return getattr(self, name)(carry[name], x, extras[name])

    def __call__(self, carry, obs, rollout_extras=None):
        extras = rollout_extras or dict.fromkeys(self.stateful)
        outs = {}
        x = self.features(obs)
        hidden = self.actor_torso(x)
        if self.bottleneck is not None:
            outs["bottleneck"] = self.child("bottleneck", carry, hidden, extras)
            hidden = outs["bottleneck"].output
        logits_or_mean = self.actor_head(hidden)
        outs["sampler"] = self.child("sampler", carry, logits_or_mean, extras)
        output = dict(outs["sampler"].output, value=self.critic(x)[..., 0])
        if self.bottleneck is not None:
            output["latent"] = hidden
        return Output(
            next_state={name: out.next_state for name, out in outs.items()},
            output=output,
            regularization_loss=sum(out.regularization_loss for out in outs.values()),
            metrics={k: v for out in outs.values() for k, v in out.metrics.items()},
            rollout_extras={name: out.rollout_extras for name, out in outs.items()},
        )


# ======================================= Environment =======================================
POSITIONS = {"CartPole-v1": [0, 2], "Pendulum-v1": [0, 1]}  # what --mask-velocity keeps


def make_env(args: Args):
    """gymnax.make of a registered id or, given `package.module:Class`, that class built with no
    arguments (any env with gymnax 1.0's API), with errors that name the flag: (env, params)."""
    module_name, _, class_name = args.env_id.rpartition(":")
    if module_name:
        try:
            env_class = getattr(importlib.import_module(module_name), class_name)
        except ImportError as error:
            raise ValueError(
                f"--env-id {args.env_id}: cannot import {module_name} ({error}); "
                "install the package that provides it"
            ) from None
        except AttributeError:
            raise ValueError(
                f"--env-id {args.env_id}: {module_name} has no {class_name}"
            ) from None
    elif args.env_id not in gymnax.registered_envs:
        choices = ", ".join(gymnax.registered_envs)
        raise ValueError(
            f"--env-id {args.env_id!r} is not a gymnax environment (nor "
            "package.module:Class); choose one of: " + choices
        )
    if args.mask_velocity and args.env_id not in POSITIONS:
        raise ValueError(
            f"--mask-velocity supports --env-id {' or '.join(POSITIONS)}, not {args.env_id}"
        )
    try:
        if not module_name:
            return gymnax.make(args.env_id)
        env = env_class()
        return env, env.default_params
    # e.g. an env that downloads its data, on an offline machine
    except Exception as error:
        raise ValueError(
            f"--env-id {args.env_id}: could not build it ({error})"
        ) from None


class Norm(NamedTuple):  # running moments, as gym's normalization wrappers keep them
    obs: dict  # mean, var and count of the observations
    ret: dict  # the same of the discounted returns
    discounted: jax.Array  # each env's discounted return so far, [B]


def observe(obs: jax.Array, args: Args, norm: Optional[Norm] = None) -> jax.Array:
    """[B, ...] env observations as float32 inputs, [B, features] (with --encoder conv: images
    [B, H, W, C]), masked with --mask-velocity and, given the statistics `norm`, normalized with
    --norm-obs."""
    if args.encoder == "mlp":
        obs = obs.reshape(obs.shape[0], -1)
    obs = obs.astype(jnp.float32)
    if args.mask_velocity:
        obs = obs[:, POSITIONS[args.env_id]]
    if norm is None or not args.norm_obs:
        return obs
    return jnp.clip(
        (obs - norm.obs["mean"]) / jnp.sqrt(norm.obs["var"] + 1e-8), -10, 10
    )


def moments(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean and variance over axis 0."""
    mean = x.mean(0)
    return mean, ((x - mean) ** 2).mean(0)


def update_moments(m: dict, x: jax.Array) -> dict:  # merged with a batch x, [B, ...]
    mean, var = moments(x)
    n = x.shape[0]
    delta = mean - m["mean"]
    count = m["count"] + n
    m2 = m["var"] * m["count"] + var * n + delta**2 * m["count"] * n / count
    return dict(mean=m["mean"] + delta * n / count, var=m2 / count, count=count)


def new_moments(x: jax.Array) -> dict:
    return dict(mean=jnp.zeros_like(x), var=jnp.ones_like(x), count=jnp.array(1e-4))


def init_norm(obs: jax.Array, args: Args) -> Norm:
    """Having seen the reset observations, as gym."""
    norm_obs = new_moments(obs[0])
    if args.norm_obs:
        norm_obs = update_moments(norm_obs, obs)
    return Norm(
        obs=norm_obs, ret=new_moments(obs[0, 0]), discounted=jnp.zeros(len(obs))
    )


def update_norm(norm: Norm, obs, reward, done, args: Args) -> tuple[Norm, jax.Array]:
    """The statistics after a step (updated between network calls) and its rewards, scaled."""
    if args.norm_obs:
        norm = norm._replace(obs=update_moments(norm.obs, obs))
    if not args.norm_reward:
        return norm, reward
    discounted = norm.discounted * args.gamma + reward
    ret = update_moments(norm.ret, discounted)
    norm = norm._replace(ret=ret, discounted=jnp.where(done, 0.0, discounted))
    return norm, jnp.clip(reward / jnp.sqrt(ret["var"] + 1e-8), -10, 10)


def build_model(args: Args, env, env_params, rngs: nnx.Rngs) -> ActorCritic:
    """The actor-critic for this env; the sampler follows from the action space."""
    obs_shape = observe(
        jnp.zeros((1,) + env.observation_space(env_params).shape), args
    ).shape[1:]
    # bounds built with jnp stay concrete under jit
    with jax.ensure_compile_time_eval():
        space = env.action_space(env_params)
    if isinstance(space, spaces.Discrete):
        return ActorCritic(obs_shape, space.n, CategoricalSampler(rngs), args, rngs)
    size = int(np.prod(space.shape))
    low = np.broadcast_to(np.asarray(space.low, np.float32), (size,))
    high = np.broadcast_to(np.asarray(space.high, np.float32), (size,))
    sampler = GaussianSampler(size, tuple(low.tolist()), tuple(high.tolist()), rngs)
    return ActorCritic(obs_shape, size, sampler, args, rngs)


# ========================================= Rollout =========================================
class Runner(NamedTuple):  # what the rollout carries from one iteration to the next
    env_state: Any
    obs: jax.Array  # the network's next input, normalized
    carry: Any  # the network's per-env state
    episode_return: jax.Array  # [B] running sums of the episodes under way
    episode_length: jax.Array
    key: jax.Array  # for the envs' steps
    norm: Norm


class Transition(NamedTuple):
    """One step of every env; the rollout stacks them into [T, B, ...]."""

    obs: jax.Array
    carry: Any  # the carry the network was called with
    rollout_extras: Any  # the raw sampled actions, keyed like the carry
    output: dict  # action, log_prob, entropy, value (and latent)
    reward: jax.Array  # scaled with --norm-reward
    terminated: jax.Array
    truncated: jax.Array
    final_obs: jax.Array  # the observation the step led to, before any auto-reset
    # of the episode that ended at this step (unscaled), else 0
    episode_return: jax.Array
    episode_length: jax.Array


def merge(graphdef, params, rest) -> ActorCritic:
    """Fresh variables: no write leaves a pass."""
    return nnx.merge(graphdef, params, rest, copy=True)


def rollout(graphdef, params, rest, env, env_params, runner: Runner, args: Args):
    """Act for num_steps in every env: (runner, [T, B] transitions)."""
    env_step = jax.vmap(env.step, in_axes=(0, 0, 0, None))

    def step(runner: Runner, _):
        model = merge(graphdef, params, rest)
        out = model(runner.carry, runner.obs)
        key, step_key = jax.random.split(runner.key)
        env_keys = jax.random.split(step_key, args.num_envs)
        obs, env_state, reward, terminated, truncated, info = env_step(
            env_keys, runner.env_state, out.output["action"], env_params
        )
        done = terminated | truncated
        norm, scaled_reward = update_norm(
            runner.norm, observe(obs, args), reward, done, args
        )
        episode_return = runner.episode_return + reward
        episode_length = runner.episode_length + 1
        transition = Transition(
            obs=runner.obs,
            carry=runner.carry,
            rollout_extras=out.rollout_extras,
            output=out.output,
            reward=scaled_reward,
            terminated=terminated,
            truncated=truncated,
            final_obs=observe(info["final_observation"], args, norm),
            episode_return=jnp.where(done, episode_return, 0.0),
            episode_length=jnp.where(done, episode_length, 0),
        )
        runner = Runner(
            env_state=env_state,
            obs=observe(obs, args, norm),
            carry=carry_after_step(model, out.next_state, done),
            episode_return=jnp.where(done, 0.0, episode_return),
            episode_length=jnp.where(done, 0, episode_length),
            key=key,
            norm=norm,
        )
        return runner, transition

    return jax.lax.scan(step, runner, length=args.num_steps)


# ======================================== Advantages =======================================
def bootstrap_values(model: ActorCritic, t: Transition) -> jax.Array:
    """V(final observation) of every step, [T, B], in one batched pass."""
    return model.value(flatten_steps(t.final_obs)).reshape(t.reward.shape)


def compute_gae(t: Transition, next_values: jax.Array, args: Args):
    """GAE over [T, B]: (advantages, returns). `next_values` is V of the observation each step
    led to, before any auto-reset: a time limit bootstraps from it, termination does not."""

    def backward(next_advantage, step):
        reward, value, next_value, terminated, truncated = step
        delta = reward + args.gamma * next_value * (1.0 - terminated) - value
        not_done = 1.0 - (terminated | truncated)
        advantage = delta + args.gamma * args.gae_lambda * not_done * next_advantage
        return advantage, advantage

    values = t.output["value"]
    steps = (t.reward, values, next_values, t.terminated, t.truncated)
    _, advantages = jax.lax.scan(
        backward, jnp.zeros_like(values[0]), steps, reverse=True
    )
    return advantages, advantages + values


# ======================================= Loss replay =======================================
class Batch(NamedTuple):
    """What one loss evaluation consumes (rollout_batch says in what shape)."""

    obs: jax.Array
    carry: Any
    rollout_extras: Any
    log_prob: jax.Array
    value: jax.Array
    advantage: jax.Array
    returns: jax.Array


def rollout_batch(t: Transition, advantages: jax.Array, returns: jax.Array) -> Batch:
    """The rollout as samples, [T * B, ...], shuffled freely: each holds all replay needs."""
    batch = Batch(
        obs=t.obs,
        carry=t.carry,
        rollout_extras=t.rollout_extras,
        log_prob=t.output["log_prob"],
        value=t.output["value"],
        advantage=advantages,
        returns=returns,
    )
    return flatten_steps(batch)


def replay(graphdef, params, rest, batch: Batch) -> Output:
    """The rollout's outputs, recomputed from what the rollout stored."""
    return merge(graphdef, params, rest)(batch.carry, batch.obs, batch.rollout_extras)


def split_minibatches(
    batch: Batch, permutation: jax.Array, num_minibatches: int
) -> Batch:
    """Shuffle the samples and cut them into [num_minibatches, minibatch_size, ...]."""

    def split(x):
        return x[permutation].reshape((num_minibatches, -1) + x.shape[1:])

    return jax.tree.map(split, batch)


def ppo_loss(graphdef, params, rest, batch: Batch, args: Args):
    """CleanRL's PPO loss on a minibatch, via the replay: (loss, metrics)."""
    out = replay(graphdef, params, rest, batch)
    log_ratio = out.output["log_prob"] - batch.log_prob
    ratio = jnp.exp(log_ratio)
    advantage = batch.advantage
    if args.norm_adv:
        mean, var = moments(advantage.reshape(-1))  # over the whole minibatch
        advantage = (advantage - mean) / (jnp.sqrt(var) + 1e-8)
    clipped_ratio = jnp.clip(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
    policy_loss = jnp.maximum(-advantage * ratio, -advantage * clipped_ratio).mean()
    new_value = out.output["value"]
    value_loss = (new_value - batch.returns) ** 2
    if args.clip_vloss:
        clipped = batch.value + jnp.clip(
            new_value - batch.value, -args.clip_coef, args.clip_coef
        )
        value_loss = jnp.maximum(value_loss, (clipped - batch.returns) ** 2)
    value_loss = 0.5 * value_loss.mean()
    entropy = out.output["entropy"].mean()
    loss = policy_loss - args.ent_coef * entropy + args.vf_coef * value_loss
    loss = loss + out.regularization_loss.mean()
    return loss, {
        "losses/value_loss": value_loss,
        "losses/policy_loss": policy_loss,
        "losses/entropy": entropy,
        "losses/old_approx_kl": (-log_ratio).mean(),
        "losses/approx_kl": ((ratio - 1) - log_ratio).mean(),
        "losses/clipfrac": (jnp.abs(ratio - 1.0) > args.clip_coef).mean(),
        **out.metrics,
    }


# ========================================== Update =========================================
def make_optimizer(args: Args):
    """Adam with global-norm clipping, and the learning rate of iteration i."""
    updates_per_iteration = args.update_epochs * args.num_minibatches

    def learning_rate(count):  # annealed linearly per iteration, as in CleanRL
        left = 1.0 - (count // updates_per_iteration) / args.num_iterations
        return args.learning_rate * (left if args.anneal_lr else jnp.ones_like(left))

    def iteration_learning_rate(i):
        return learning_rate(i * updates_per_iteration)

    clipped_adam = optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm),
        optax.adam(learning_rate, eps=1e-5),
    )
    # one flat vector, not a dozen small leaves: each step runs a few large kernels
    return optax.flatten(clipped_adam), iteration_learning_rate


def update(graphdef, params, rest, optimizer, opt_state, batch: Batch, key, args: Args):
    """update_epochs passes of shuffled minibatch steps: (params, opt_state, mean metrics)."""
    loss_grad = jax.grad(ppo_loss, argnums=1, has_aux=True)

    def minibatch_step(state, minibatch):
        params, opt_state = state
        grads, metrics = loss_grad(graphdef, params, rest, minibatch, args)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), metrics

    def epoch(state, permutation):
        minibatches = split_minibatches(batch, permutation, args.num_minibatches)
        return jax.lax.scan(minibatch_step, state, minibatches)

    def draw(key, _):  # in a scan of its own, before the epochs: one key chain for all
        key, subkey = jax.random.split(key)
        return key, jax.random.permutation(subkey, args.batch_size)

    _, permutations = jax.lax.scan(draw, key, length=args.update_epochs)
    (params, opt_state), metrics = jax.lax.scan(
        epoch, (params, opt_state), permutations
    )
    return params, opt_state, jax.tree.map(jnp.mean, metrics)


# ====================================== Training loop ======================================
class TrainState(NamedTuple):
    """One seed's training: all that a stopped run resumes from."""

    params: Any
    opt_state: Any
    runner: Runner
    iteration: jax.Array  # the iterations done
    update_key: jax.Array  # split into every iteration's key (see chunk)


def make_chunk(args: Args):
    """Pure functions of one seed: `init(key) -> TrainState`, and `chunk(state, n, size, config)`,
    which runs n <= size iterations on from `state` with the --sweep values `config` (traced, or
    None): (state, metrics [size], NaN past row n)."""
    args = check_args(args)
    env, env_params = make_env(args)
    optimizer, _ = make_optimizer(args)

    def init(key) -> TrainState:
        # Philox: the default Threefry is a rolled loop on CPU, costly in per-step draws
        key = jax.random.key(jax.random.bits(key, dtype=jnp.uint32), impl="philox2x32")
        init_key, reset_key, runner_key, update_key = jax.random.split(key, 4)
        model = build_model(args, env, env_params, nnx.Rngs(init_key))
        params = nnx.state(model, nnx.Param)
        reset_keys = jax.random.split(reset_key, args.num_envs)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(reset_keys, env_params)
        norm = init_norm(observe(obs, args), args)
        runner = Runner(
            env_state=env_state,
            obs=observe(obs, args, norm),
            carry=model.initialize_state(args.num_envs),
            episode_return=jnp.zeros(args.num_envs),
            episode_length=jnp.zeros(args.num_envs, int),
            key=runner_key,
            norm=norm,
        )
        return TrainState(
            params=params,
            opt_state=optimizer.init(params),
            runner=runner,
            iteration=jnp.array(0),
            update_key=update_key,
        )

    def iteration(args, graphdef, rest, update_keys, state: TrainState):
        optimizer, learning_rate = make_optimizer(args)
        params, opt_state = state.params, state.opt_state
        runner, t = rollout(graphdef, params, rest, env, env_params, state.runner, args)
        next_values = bootstrap_values(merge(graphdef, params, rest), t)
        advantages, returns = compute_gae(t, next_values, args)
        batch = rollout_batch(t, advantages, returns)
        update_key = update_keys[state.iteration]
        params, opt_state, metrics = update(
            graphdef, params, rest, optimizer, opt_state, batch, update_key, args
        )
        episodes = (t.terminated | t.truncated).sum()
        _, returns_var = moments(returns.reshape(-1))
        _, residual_var = moments((returns - t.output["value"]).reshape(-1))
        # NaN for constant returns, as in CleanRL
        explained = jnp.where(
            returns_var > 0, 1.0 - residual_var / returns_var, jnp.nan
        )
        # NaN: none ended
        metrics["charts/episodic_return"] = t.episode_return.sum() / episodes
        metrics["charts/episodic_length"] = t.episode_length.sum() / episodes
        metrics["charts/learning_rate"] = learning_rate(state.iteration)
        metrics["losses/explained_variance"] = explained
        state = state._replace(
            params=params,
            opt_state=opt_state,
            runner=runner,
            iteration=state.iteration + 1,
        )
        return state, metrics

    def chunk(state: TrainState, n, size: int, config: Optional[dict] = None):
        configured = dataclasses.replace(args, **(config or {}))
        # the network's structure and its nnx.Rngs (read only by init); the Params are the state's
        model = build_model(configured, env, env_params, nnx.Rngs(0))
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)
        # every iteration's key, split once for the whole run: chunks draw what one call draws
        update_keys = jax.random.split(state.update_key, args.num_iterations)
        step = functools.partial(iteration, configured, graphdef, rest, update_keys)
        metrics_shape = jax.eval_shape(step, state)[1]
        rows = jax.tree.map(
            lambda x: jnp.full((size,) + x.shape, jnp.nan, x.dtype), metrics_shape
        )

        def body(j, carry):
            state, rows = carry
            state, metrics = step(state)
            return state, jax.tree.map(lambda row, x: row.at[j].set(x), rows, metrics)

        return jax.lax.fori_loop(0, n, body, (state, rows))

    return init, chunk


def make_train(args: Args):
    """`train(key, config=None) -> (TrainState, metrics [num_iterations])`: the whole run as one
    pure function, for `jax.vmap` over keys and over `config`, a dict of values of SWEEPABLE
    fields; `main` runs the same iterations in chunks."""
    init, chunk = make_chunk(args)

    def train(key, config=None):
        return chunk(init(key), args.num_iterations, args.num_iterations, config)

    return train


# ==================================== Seeds and devices ====================================
def devices(args: Args) -> list:
    """The devices (of all hosts) sharing the seeds or, with --shard-envs, the envs equally."""
    if args.shard_envs:
        n, name = args.num_envs, "--num-envs"
    elif args.sweep:
        configs = f"{len(args.configs)} --sweep configurations"
        n, name = len(args.members), f"--num-seeds {args.num_seeds} x {configs} ="
    else:
        n, name = args.num_seeds, "--num-seeds"
    if n == 1 and not args.shard_envs and jax.process_count() == 1:
        return jax.devices()[:1]
    if n % jax.device_count():
        raise ValueError(
            f"{name} {n} must be a multiple of the {jax.device_count()} devices "
            "(CUDA_VISIBLE_DEVICES or JAX_PLATFORMS=cpu can show fewer)"
        )
    # each host's seeds in a row
    return sorted(jax.devices(), key=lambda d: d.process_index)


def over_seeds(f, per_seed):
    """f of one seed on a stack of seeds: jax.vmap, but not over one seed (slower on CPU)."""
    if jax.tree.leaves(per_seed)[0].shape[0] > 1:
        return jax.vmap(f)(per_seed)
    one = jax.tree.map(functools.partial(jnp.squeeze, axis=0), per_seed)
    return jax.tree.map(functools.partial(jnp.expand_dims, axis=0), f(one))


def sweep_values(args: Args, index: jax.Array) -> dict:
    """The --sweep values of run `index` of args.members, traced: a row of the grid."""
    configs = args.configs
    columns = {field: jnp.array([c[field] for c in configs]) for field in configs[0]}
    return {field: column[index // args.num_seeds] for field, column in columns.items()}


def env_placement(args: Args, mesh, state: TrainState) -> TrainState:
    """Shardings for --shard-envs: the runner's [seed, env, ...] arrays split envs over the
    devices, everything else is whole on each."""
    seeds = NamedSharding(mesh, P("seeds"))
    per_env = NamedSharding(mesh, P("seeds", "envs"))

    def placed(x):
        return per_env if x.ndim > 1 and x.shape[1] == args.num_envs else seeds

    # a prefix of the state's tree: one sharding for each whole field
    whole = TrainState(**dict.fromkeys(TrainState._fields, seeds))
    return whole._replace(runner=jax.tree.map(placed, state.runner))


def compile_run(args: Args):
    """The programs that train args.members, each --sweep configuration with seeds args.seed ..
    args.seed + num_seeds - 1 (seed i of N trains as `--seed i` alone) on the devices: (init() ->
    state, chunk(state, n) -> (state, metrics [run, chunk_size], NaN past n), compile seconds).
    A run that cannot fit in the devices' memory is refused here, before it trains.

    Runs are independent: each device runs the one-device program on its share (shard_map).
    With --shard-envs, one seed's per-env arrays split their axis 1 over the devices, and jax.jit
    partitions the one-device program to match, adding the sums over devices it needs."""
    init, chunk = make_chunk(args)
    # GSPMD: Shardy (jax 0.11) cannot lower Philox's mulhi for arrays split over processes
    jax.config.update("jax_use_shardy_partitioner", False)
    shape = (1, -1) if args.shard_envs else (-1, 1)
    mesh = jax.sharding.Mesh(np.reshape(devices(args), shape), ("seeds", "envs"))

    def init_seeds(member):
        def init_seed(index):
            return init(jax.random.key(args.seed + index % args.num_seeds))

        return over_seeds(init_seed, member)

    def chunk_seeds(member, state, n):
        def chunk_seed(index_and_state):
            index, state = index_and_state
            return chunk(state, n, args.chunk_size, sweep_values(args, index))

        return over_seeds(chunk_seed, (member, state))

    seeds = NamedSharding(mesh, P("seeds"))
    replicated = NamedSharding(mesh, P())  # the metrics, for every host to read

    def member_numbers(index):  # on every host, the runs of its own devices
        return np.arange(len(args.members))[index]

    member = jax.make_array_from_callback((len(args.members),), seeds, member_numbers)
    start = time.time()
    if mesh.size == 1:  # the plain program: no placement to arrange
        init_seeds, chunk_seeds = jax.jit(init_seeds), jax.jit(chunk_seeds)
    elif args.shard_envs:
        placement = env_placement(args, mesh, jax.eval_shape(init_seeds, member))
        init_seeds = jax.jit(init_seeds, out_shardings=placement)
        chunk_seeds = jax.jit(chunk_seeds, out_shardings=(placement, replicated))
    else:
        # check_vma=False: no collective runs inside, and the scans' carries need no typing
        over_devices = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
        init_seeds = over_devices(init_seeds, in_specs=P("seeds"), out_specs=P("seeds"))
        chunk_seeds = over_devices(
            chunk_seeds, in_specs=(P("seeds"), P("seeds"), P()), out_specs=P("seeds")
        )
        init_seeds = jax.jit(init_seeds, out_shardings=seeds)
        chunk_seeds = jax.jit(chunk_seeds, out_shardings=(seeds, replicated))
    init_seeds = init_seeds.lower(member).compile()
    chunk_seeds = chunk_seeds.lower(
        member, init_seeds.out_info, args.chunk_size
    ).compile()
    check_memory(args, chunk_seeds)
    program = (
        functools.partial(init_seeds, member),
        functools.partial(chunk_seeds, member),
    )
    return *program, time.time() - start


def check_memory(args: Args, compiled) -> None:
    """Refuse, naming the flags, a chunk program larger than its device's memory (XLA's count)."""
    stats, device = compiled.memory_analysis(), jax.local_devices()[0]
    need = stats.argument_size_in_bytes + stats.output_size_in_bytes
    need += stats.temp_size_in_bytes - stats.alias_size_in_bytes
    if device.platform == "cpu":  # every CPU device shares the host's memory
        need *= jax.local_device_count()
    have = free_memory(device)
    if need > have:
        raise ValueError(
            f"the run needs about {need / 2**30:.1f} GiB of memory and the {device.platform} has "
            f"{have / 2**30:.1f} GiB free: lower --num-envs {args.num_envs}, --num-steps "
            f"{args.num_steps} or --num-seeds {args.num_seeds}"
        )


def free_memory(device) -> float:  # bytes that the device can still allocate
    if device.platform != "cpu":
        return (device.memory_stats() or {}).get("bytes_limit", math.inf)
    try:  # Linux: what can be allocated without swapping, the page cache included
        with open("/proc/meminfo") as meminfo:
            lines = [line for line in meminfo if line.startswith("MemAvailable:")]
        return int(lines[0].split()[1]) * 1024
    except (OSError, IndexError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run(args: Args, program=None, start=None, on_chunk=None, repeats: int = 1):
    """Train in chunks of compiled iterations, from the start or from `start` = (state, metrics,
    iterations done) of a stopped run: (state, metrics [seed, iteration] with global_step,
    compile seconds, seconds of each of `repeats` runs). `program` is compile_run's.
    `on_chunk(state, metrics, done, seconds)` runs on the host after each chunk: False stops."""
    init, chunk, compile_s = program or compile_run(args)
    # int64: global_step passes 2**31 in long runs
    steps = args.batch_size * np.arange(1, args.num_iterations + 1, dtype=np.int64)
    waiter = concurrent.futures.ThreadPoolExecutor(1)
    train_s = []
    for _ in range(repeats):
        begin = time.time()
        state, metrics, done = start or (init(), {}, 0)
        metrics = {
            "global_step": np.broadcast_to(steps, (len(args.members), len(steps))),
            **metrics,
        }
        n = args.chunk_iterations or 1
        while done < args.num_iterations:
            n = min(n, args.num_iterations - done)
            called = time.time()
            state, rows = chunk(state, n)
            # waited for in a thread: the main thread then runs a signal's handler at once
            rows = waiter.submit(jax.device_get, rows).result()
            for k, v in rows.items():
                metrics.setdefault(
                    k, np.full(metrics["global_step"].shape, np.nan, v.dtype)
                )
                metrics[k][:, done : done + n] = v[:, :n]
            done += n
            # about a second a call: each call costs a few ms
            if not args.chunk_iterations:
                n = max(
                    1, min(args.chunk_size, round(n / max(time.time() - called, 1e-3)))
                )
            # every host runs the chunks that process 0 runs
            if jax.process_count() > 1:
                n = int(multihost_utils.broadcast_one_to_all(np.int32(n)))
            if (
                on_chunk
                and on_chunk(state, metrics, done, time.time() - begin) is False
            ):
                break
        jax.block_until_ready(state)
        train_s.append(time.time() - begin)
    return state, metrics, compile_s, train_s


# ================================ Evaluation and checkpoints ===============================
def evaluate(args: Args, params, norm: Norm) -> np.ndarray:
    """[run, episode] returns of each run's policy: an episode per env, the statistics frozen."""
    env, env_params = make_env(args)
    n = args.eval_episodes or 10  # 10: for --eval-checkpoint
    env_reset = jax.vmap(env.reset, in_axes=(0, None))
    env_step = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    action = "mode" if args.eval_deterministic else "action"

    def episodes(seed, params, norm):
        key = jax.random.fold_in(jax.random.key(seed), 1)
        model_key, env_key, key = jax.random.split(key, 3)
        # its structure and rngs; the trained Params are merged in at each step
        model = build_model(args, env, env_params, nnx.Rngs(model_key))
        carry = model.initialize_state(n)
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)
        obs, env_state = env_reset(jax.random.split(env_key, n), env_params)

        def step(state):
            env_state, obs, carry, key, total, ended = state
            out = merge(graphdef, params, rest)(carry, observe(obs, args, norm))
            key, step_key = jax.random.split(key)
            step_keys = jax.random.split(step_key, n)
            obs, env_state, reward, terminated, truncated, _ = env_step(
                step_keys, env_state, out.output[action], env_params
            )
            total = total + jnp.where(ended, 0.0, reward)
            ended = ended | terminated | truncated
            return env_state, obs, out.next_state, key, total, ended

        def running(state):
            return ~state[-1].all()

        state = (env_state, obs, carry, key, jnp.zeros(n), jnp.zeros(n, bool))
        return jax.lax.while_loop(running, step, state)[-2]

    seeds = jnp.array([seed for _, seed in args.members])
    returns = jax.jit(jax.vmap(episodes))(seeds, params, norm)
    return np.asarray(returns)


def refuse_changes(cli: Args, saved_flag: str, allowed: tuple) -> None:
    """--eval-checkpoint and --resume take the saved run's flags: only `allowed` may be given."""
    for name, value in vars(cli).items():
        if value != getattr(Args, name) and name not in allowed:
            flags = ", ".join(map(flag, allowed))
            raise ValueError(
                f"{flag(name)} cannot change the run saved at "
                f"{getattr(cli, saved_flag)}: only {flags} apply to it"
            )


def restore(path: str, **items):  # the named items of one Orbax checkpoint
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    return checkpointer.restore(os.path.abspath(path), args=ocp.args.Composite(**items))


def load_run(cli: Args):
    """(Args, params, norm) of the run saved at --eval-checkpoint, seeds stacked."""
    check_args(cli)  # the flags given, before the saved ones
    path = cli.eval_checkpoint
    # this evaluation's own flags
    own = (
        "eval_checkpoint",
        "eval_episodes",
        "eval_deterministic",
        "track",
        "wandb_project_name",
        "wandb_entity",
    )
    refuse_changes(cli, "eval_checkpoint", own)
    if os.path.isdir(path) and not glob.glob(os.path.join(glob.escape(path), "seed_*")):
        sweep = sorted(glob.glob(os.path.join(glob.escape(path), "*", "seed_*")))
        if os.path.basename(os.path.normpath(path)).startswith("seed_"):
            hint = f"it is one seed's; give its run folder, {os.path.dirname(path)}"
        elif sweep:
            hint = f"it is a --sweep's; give a configuration's, {os.path.dirname(sweep[0])}"
        elif os.path.isdir(os.path.join(path, "state")):
            hint = f"it is a stopped run; --resume {path} finishes it"
        else:
            hint = "give a folder runs/{run_name} that --save-model wrote"
        raise ValueError(f"--eval-checkpoint {path} holds no seed_* model: {hint}")
    try:  # each seed's entry holds the Args; params go into the shapes of nnx.eval_shape's model
        first = next(e for e in sorted(os.listdir(path)) if e.startswith("seed_"))
        saved = restore(os.path.join(path, first), args=ocp.args.JsonRestore())["args"]
        if saved["script"] != os.path.basename(__file__):
            raise ValueError(
                f"{saved['script']} saved it: evaluate it with that script"
            )
        flags = {**saved["args"], "save_model": False}
        args = check_args(Args(**{**flags, **{k: getattr(cli, k) for k in own}}))
        model = nnx.eval_shape(lambda: build_model(args, *make_env(args), nnx.Rngs(0)))
        like = nnx.state(model, nnx.Param)
        seeds = []
        for seed in args.seeds:
            # norm comes back as a dict of its fields
            items = restore(
                f"{path}/seed_{seed}",
                params=ocp.args.StandardRestore(like),
                norm=ocp.args.StandardRestore(),
            )
            seeds.append((items["params"], Norm(**items["norm"])))
        return args, *jax.tree.map(lambda *x: jnp.stack(x), *seeds)
    except Exception as error:  # missing, corrupt, another script's
        raise ValueError(
            f"--eval-checkpoint {path} is not a run saved by "
            f"{os.path.basename(__file__)} ({error!r:.200})"
        ) from None


def reserve_run_dir(args: Args) -> tuple[str, int]:
    """Create runs/{env_id}__{exp_name}__{seed}__{stamp} before anything compiles, with the next
    free stamp if it is taken (runs started in the same second), and prove it writable."""
    stamp, error = int(time.time()), ""
    env_name = args.env_id.replace("/", "-")  # suites:SUITE/NAME, as one folder
    prefix = f"runs/{env_name}__{args.exp_name}__{args.seed}__"  # CleanRL's run name
    if jax.process_index() == 0:  # on a shared file system, one host reserves for all
        try:
            os.makedirs("runs", exist_ok=True)
            while not try_mkdir(f"{prefix}{stamp}"):
                stamp += 1
            tempfile.TemporaryFile(dir=f"{prefix}{stamp}").close()
        except OSError as err:
            error, stamp = f"{err.strerror}: {err.filename}", -1
    if jax.process_count() > 1:
        stamp = int(multihost_utils.broadcast_one_to_all(np.int32(stamp)))
    if stamp < 0:
        raise ValueError(
            f"cannot write the run folder in {os.path.abspath('runs')} ("
            f"{error or 'on process 0'}): start the run where runs/ can be written"
        )
    return f"{prefix}{stamp}", stamp


def try_mkdir(path: str) -> bool:
    """False if it exists: mkdir is atomic, exists-then-mkdir is not."""
    try:
        os.mkdir(path)
        return True
    except FileExistsError:
        return False


def checkpoints(run_dir: str) -> ocp.CheckpointManager:
    """runs/{run_name}/state/{iteration}: the newest training state only. Orbax writes a step to a
    temporary folder and renames it when complete, so a kill mid-write keeps the one before."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=1, enable_async_checkpointing=False
    )
    return ocp.CheckpointManager(os.path.abspath(f"{run_dir}/state"), options=options)


def save_state(
    run_dir: str, state: TrainState, metrics: dict, done: int, meta: dict
) -> None:
    """The whole training state after `done` iterations, every iteration's metrics so far, and
    `meta` (the Args, the W&B run ids): what --resume continues from."""
    history = {k: v for k, v in metrics.items() if k != "global_step"}
    items = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave(meta),
        history=ocp.args.StandardSave(history),
    )
    with checkpoints(run_dir) as manager:
        if manager.latest_step() != done:
            manager.save(done, args=items)


def load_stopped(cli: Args) -> tuple[Args, dict]:
    """(Args, meta) of the stopped run at --resume; meta["done"]: the iterations it ran."""
    check_args(cli)
    path = cli.resume
    # flags that leave the run's numbers alone
    own = (
        "resume",
        "save_model",
        "save_every",
        "chunk_iterations",
        "eval_episodes",
        "eval_deterministic",
    )
    refuse_changes(cli, "resume", own)
    if not os.path.isdir(os.path.join(path, "state")):
        raise ValueError(
            f"--resume {path} holds no training state (a state/ folder): give a "
            "runs/{run_name} that a stopped run or --save-every saved"
        )
    try:
        with checkpoints(path) as manager:
            done = manager.latest_step()
            items = ocp.args.Composite(meta=ocp.args.JsonRestore())
            meta = dict(manager.restore(done, args=items)["meta"], done=done)
        if meta["script"] != os.path.basename(__file__):
            raise ValueError(f"{meta['script']} saved it: resume it with that script")
        args = check_args(Args(**{**meta["args"], **{k: getattr(cli, k) for k in own}}))
    except Exception as error:  # missing, corrupt, another script's
        raise ValueError(
            f"--resume {path} is not a run saved by {os.path.basename(__file__)} "
            f"({error!r:.200})"
        ) from None
    if done == args.num_iterations:
        raise ValueError(
            f"--resume {path}: the run has finished; --eval-checkpoint {path} "
            "evaluates it"
        )
    return args, meta


def restore_state(
    run_dir: str, done: int, like: TrainState
) -> tuple[TrainState, dict, int]:
    """The state saved after `done` iterations, placed on the devices as `like`, and the metrics."""
    items = ocp.args.Composite(
        state=ocp.args.StandardRestore(like), history=ocp.args.StandardRestore()
    )
    with checkpoints(run_dir) as manager:
        saved = manager.restore(done, args=items)
    return saved["state"], {k: np.array(v) for k, v in saved["history"].items()}, done


def save_model(folder: str, args: Args, params, norm: Norm) -> None:
    """An Orbax checkpoint per seed, seed_{seed}: its params and statistics, and the Args that
    train it alone. A --sweep's configurations each get a folder, named by config_name."""
    for i, (config, seed) in enumerate(args.members):
        alone = dataclasses.replace(args, **config, sweep=())
        flags = dict(script=os.path.basename(__file__), args=dataclasses.asdict(alone))
        params_i, norm_i = jax.tree.map(lambda x: x[i], (params, norm))
        items = ocp.args.Composite(
            params=ocp.args.StandardSave(params_i),
            norm=ocp.args.StandardSave(norm_i),
            args=ocp.args.JsonSave(flags),
        )
        path = os.path.join(folder, config_name(config), f"seed_{seed}")
        ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(
            os.path.abspath(path), args=items
        )


def keep(run_dir: str, what: str, write) -> tuple[Optional[str], str]:
    """write(folder) into the run folder or, failing that (a full disk), a temporary folder:
    (the folder, or None if both failed; one line saying where, or what was lost and why)."""
    errors = []
    for folder in (run_dir, f"{tempfile.gettempdir()}/{os.path.basename(run_dir)}"):
        try:
            os.makedirs(folder, exist_ok=True)
            with quiet():
                write(folder)
            not_there = f" (not {'; '.join(errors)})" if errors else ""
            return folder, f"saved {what}: {folder}{not_there}"
        except Exception as error:  # OSError, or Orbax's own on a full disk
            errors.append(
                f"{folder}: {str(error).splitlines()[0][:160] or repr(error)}"
            )
            partials = f"{glob.escape(folder)}/**/*.orbax-checkpoint-tmp*"
            # Orbax's half-written folders
            for partial in glob.glob(partials, recursive=True):
                shutil.rmtree(partial, ignore_errors=True)
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


# ========================================== Logging ========================================
def final_return(metrics: dict) -> np.ndarray:
    """Mean episodic return over the last 5% of iterations, per run (NaN if none ended)."""
    returns = np.asarray(metrics["charts/episodic_return"])
    last = returns[..., -max(1, returns.shape[-1] // 20) :]
    ended = (~np.isnan(last)).sum(-1)
    return np.where(ended > 0, np.nansum(last, -1) / np.maximum(ended, 1), np.nan)


def first_nonfinite(args: Args, metrics: dict, params=None) -> Optional[str]:
    """Where a run first went NaN or infinite: in the losses of the iterations in `metrics`, else
    in the final `params`."""
    names = [
        k
        for k in metrics
        if k.startswith("losses/") and k != "losses/explained_variance"
    ]
    # [run, i, name]
    bad = np.stack([~np.isfinite(np.asarray(metrics[k])) for k in names], -1)
    # [run]
    bad_params = np.any(
        [~np.isfinite(x.reshape(len(x), -1)).all(-1) for x in jax.tree.leaves(params)],
        axis=0,
    )
    if bad.any():
        i, k, member = np.argwhere(bad.transpose(1, 2, 0))[0]  # the earliest iteration
        what = f"{names[k]} is {float(metrics[names[k]][member, i])}"
    elif bad_params.any():
        member = bad_params.argmax()
        i = args.num_iterations - 1
        what = "the weights are not finite"
    else:
        return None
    config, seed = args.members[member]
    run = f"seed {seed}" + (f" ({config_name(config)})" if config else "")
    return (
        f"{run}: {what} at iteration {i + 1} of {args.num_iterations} "
        f"(global_step {(i + 1) * args.batch_size}); the run diverged"
    )


def sweep_table(args: Args, finals: np.ndarray, returns=None) -> str:
    """A row per --sweep configuration, best first: the mean and std over its seeds of each run's
    final return and, given the evaluation's [run, episode] `returns`, of its mean (which ranks)."""
    columns = {"final_episodic_return": finals}
    if returns is not None:
        columns["eval/episodic_return"] = returns.mean(1)
    # [configuration, seed]
    columns = {k: v.reshape(len(args.configs), -1) for k, v in columns.items()}
    ranking = list(columns)[-1]
    means = columns[ranking].mean(1)
    order = np.argsort(-np.nan_to_num(means, nan=-np.inf), kind="stable")  # NaN last
    fields = list(args.configs[0])
    header = [flag(field)[2:] for field in fields] + list(columns)
    lines = [
        f"sweep: {len(args.configs)} configurations x {args.num_seeds} seeds, "
        f"ranked by {ranking} (mean ± std over seeds)",
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
    ]
    for c in order:
        values = [f"{args.configs[c][field]:g}" for field in fields]
        stats = [f"{v[c].mean():.1f} ± {v[c].std():.1f}" for v in columns.values()]
        lines.append("| " + " | ".join(values + stats) + " |")
    return "\n".join(lines)


def init_wandb(args: Args, stamp: int, ids=None) -> list:
    """A W&B run per seed and --sweep configuration, named the CleanRL way with the configuration
    in the experiment's name (or, resuming, the runs `ids`); offline without credentials or a
    server."""
    import wandb

    def offline(why: str) -> str:
        print(
            f"notice: --track {why}; logging offline to ./wandb, `wandb sync` uploads it later",
            file=sys.stderr,
        )
        return "offline"

    mode = None  # W&B's choice: WANDB_MODE, else online
    no_key = not wandb.login(prompt=False, verify=False)
    if os.environ.get("WANDB_MODE") not in ("offline", "disabled") and no_key:
        mode = offline("found no W&B credentials (`wandb login` or WANDB_API_KEY)")
    runs = []
    for i, (config, seed) in enumerate(args.members):
        exp_name = "__".join(filter(None, [args.exp_name, config_name(config)]))
        settings = dict(
            project=args.wandb_project_name,
            entity=args.wandb_entity,
            name=f"{args.env_id}__{exp_name}__{seed}__{stamp}",
            group=f"{args.env_id}__{exp_name}__{stamp}",  # the configuration's seeds
            config={**dataclasses.asdict(args), **config, "seed": seed},
            id=ids[i] if ids else None,
            resume="allow" if ids else None,
            save_code=True,
            reinit="create_new",
        )
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
    # an episode ended there
    last = np.where(np.isnan(returns), -1, np.arange(done)).max(-1)
    latest = np.where(last >= 0, returns[np.arange(len(returns)), last], np.nan)
    if args.sweep:  # one figure per configuration: its seeds' mean
        latest = latest.reshape(len(args.configs), args.num_seeds).mean(1)
    left = seconds * (args.num_iterations - done) / (done - first)
    sps = (done - first) * args.batch_size * len(args.members) / seconds
    return (
        f"global_step={step:>9d} ({step / total:4.0%}, {left:.0f} s left)  "
        f"episodic_return={' '.join(f'{r:.1f}' for r in latest)}  SPS={sps:,.0f}"
    )


# ========================================== Main ===========================================
def train(args: Args, program, run_dir: str, first: int, meta: dict, wandb_runs: list):
    """Train in chunks from iteration `first`, logging each. The first SIGINT or SIGTERM stops at
    the end of the chunk under way and saves the state; a second stops at once: (state, metrics,
    iterations done, failure or None, the stopping signal or 0)."""
    start = restore_state(run_dir, first, program[0]()) if first else None
    signals, logged, printed, saved_at, failure = [], first, 0.0, first, None

    def on_signal(signum, frame):
        signals.append(signum)
        for s in (signal.SIGINT, signal.SIGTERM):  # a second one stops at once
            signal.signal(s, signal.SIG_DFL)

    def save(state, metrics, done):
        return keep(
            run_dir,
            "the training state",
            functools.partial(
                save_state, state=state, metrics=metrics, done=done, meta=meta
            ),
        )

    def after_chunk(state, metrics, done, seconds):
        """On the host, between compiled chunks."""
        nonlocal logged, printed, saved_at, failure
        for i in range(logged, done):  # W&B: every iteration
            for seed_index, wandb_run in enumerate(wandb_runs):
                wandb_run.log({k: v[seed_index, i].item() for k, v in metrics.items()})
        logged = done
        if time.time() - printed >= 1 or done == args.num_iterations:  # a line a second
            printed = time.time()
            print(progress(args, metrics, done, first, seconds), flush=True)
        # a sweep's diverged configurations are among its results: the others train on
        if not args.sweep:
            failure = first_nonfinite(
                args, {k: v[:, :done] for k, v in metrics.items()}
            )
        if args.save_every and done - saved_at >= args.save_every and not failure:
            folder, line = save(state, metrics, done)
            if folder:
                saved_at = done
                print(line, flush=True)
            else:
                print(f"warning: {line}", file=sys.stderr, flush=True)
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
    done, signum = logged, signals[0] if signals else 0
    if signum and not failure and done < args.num_iterations:  # keep this boundary
        folder, line = save(state, metrics, done)
        resume = (
            f"; resume with: python {meta['script']} --resume {folder}"
            if folder
            else ""
        )
        print(
            f"stopped by {signal.Signals(signum).name} at iteration {done} of "
            f"{args.num_iterations}; {line}{resume}",
            file=sys.stderr,
        )
        return state, metrics, done, failure, signum
    metrics = {k: v[:, :done] for k, v in metrics.items()}
    steps = (done - first) * args.batch_size * len(args.members)
    finals = final_return(metrics)
    for wandb_run, final in zip(wandb_runs, finals):
        wandb_run.summary["final_episodic_return"] = float(final)
    print(
        f"summary: env={args.env_id} seeds={list(args.seeds)} "
        f"final_episodic_return={[round(float(r), 2) for r in finals]} "
        f"env_steps={steps} compile_s={compile_s:.1f} train_s={train_s:.1f} "
        f"SPS={steps / train_s:,.0f}"
    )
    return state, metrics, done, failure, 0


def main(args: Args) -> None:
    if jax.process_index():  # only process 0 prints and logs
        sys.stdout = open(os.devnull, "w")
    run_dir, meta, reserved = None, {}, False
    # parse: what can be refused is, before anything compiles, in one line with exit code 2
    try:
        if args.eval_checkpoint:
            args, params, norm = load_run(args)
            stamp = int(time.time())
        elif args.resume:
            run_dir, (args, meta) = args.resume, load_stopped(args)
            stamp = meta["stamp"]
        else:
            args = check_args(args)
            run_dir, stamp = reserve_run_dir(args)
            reserved = jax.process_index() == 0  # the host that made the folder
        program = None if args.eval_checkpoint else compile_run(args)
    except ValueError as error:
        if reserved:
            os.rmdir(run_dir)  # empty: this run made it
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    wandb_runs = []
    if args.track and jax.process_index() == 0:
        wandb_runs = init_wandb(args, stamp, meta.get("wandb_ids"))
    failure, signum, exit_code = None, 0, 0
    # train, or continue a stopped run
    if not args.eval_checkpoint:
        first = meta.get("done", 0)  # iterations run before a resume
        wandb_ids = meta.get("wandb_ids") or [wandb_run.id for wandb_run in wandb_runs]
        meta = dict(
            script=os.path.basename(__file__),
            args=dataclasses.asdict(args),
            stamp=stamp,
            wandb_ids=wandb_ids,
        )
        state, metrics, done, failure, signum = train(
            args, program, run_dir, first, meta, wandb_runs
        )
        # every seed, on every host
        params, norm = jax.tree.map(
            np.asarray,
            multihost_utils.process_allgather(
                (state.params, state.runner.norm), tiled=True
            ),
        )
        if not (signum or failure):
            failure = first_nonfinite(args, metrics, params)
        if failure and args.sweep:  # ranked last in the table; every run is kept
            print(f"warning: {failure}", file=sys.stderr)
            failure = None
    # save
    if args.save_model and not (failure or signum):

        def write(folder):
            """Each seed's model, and the state with every iteration's metrics."""
            save_model(folder, args, params, norm)
            save_state(folder, state, metrics, done, meta)

        folder, line = keep(run_dir, "the model", write)
        print(
            line if folder else f"error: {line}",
            file=sys.stdout if folder else sys.stderr,
        )
        exit_code = 0 if folder else 1
    # evaluate
    returns = None
    if (args.eval_episodes or args.eval_checkpoint) and not (failure or signum):
        returns = evaluate(args, params, norm)
        for wandb_run, r in zip(wandb_runs, returns):
            wandb_run.log(
                {"eval/episodic_return": r.mean(), "eval/episodic_return_std": r.std()}
            )
        summary = " ".join(f"{r.mean():.2f}+-{r.std():.2f}" for r in returns)
        print(
            f"eval: {returns.shape[1]} episodes, deterministic={args.eval_deterministic}, "
            f"eval/episodic_return={summary}"
        )
    if args.sweep and not signum:
        print(sweep_table(args, final_return(metrics), returns))
    if failure:
        exit_code = 1
    elif signum:
        exit_code = 128 + signum
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
    # while compiling, saving or evaluating: training has its handler
    except KeyboardInterrupt:
        print(
            "stopped by SIGINT outside training; what was saved is kept",
            file=sys.stderr,
        )
        sys.exit(130)
