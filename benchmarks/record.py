"""One benchmark run, in this process, written to one JSON file.

    python benchmarks/record.py [--repeats N] [--name NAME] OUT.json SCRIPT [FLAGS...]

SCRIPT is ppo_nnx or ppo_nnx_vae_lstm (FLAGS: the script's own command-line flags; the script's
`run` compiles and times it), rejax (rejax 0.1.3's PPO, given the flags of ppo_nnx.py that it has:
the same settings, network and seeds, with ppo_nnx.py's defaults for the rest) or floor
(CartPole-v1 stepped with random actions: the env's own cost; --num-envs N, --total-timesteps N).
learning.py and speed.sh list the runs; report.py makes tables and plots of them.
"""

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import io
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from common import machine, versions

ROOT = Path(__file__).resolve().parents[1]
OURS = ("ppo_nnx", "ppo_nnx_vae_lstm")
# The flags of ppo_nnx.py that rejax's PPO has too; the floor's, with their defaults.
REJAX = (
    "env_id",
    "total_timesteps",
    "learning_rate",
    "num_envs",
    "num_steps",
    "anneal_lr",
    "gamma",
    "gae_lambda",
    "num_minibatches",
    "update_epochs",
    "clip_coef",
    "ent_coef",
    "vf_coef",
    "max_grad_norm",
    "num_seeds",
    "seed",
    "hidden_size",
    "activation",
)
FLOOR = dict(num_envs=4, total_timesteps=500_000)


def fail(message: str):
    print(f"record.py: error: {message}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        fail(
            f"{message} (usage: record.py [--repeats N] [--name NAME] OUT.json SCRIPT [FLAGS])"
        )


# ----------------------------------------------------------------------------------------------
# Flags: our scripts parse theirs with tyro; rejax and the floor take `--flag N` pairs
# ----------------------------------------------------------------------------------------------
def parse_ours(name: str, flags: list):
    import tyro

    sys.path.insert(0, str(ROOT))
    script = importlib.import_module(name)
    fields = dataclasses.fields(script.Args)
    known = [f"--{f.name.replace('_', '-')}" for f in fields]
    switches = [f"--no-{f.name.replace('_', '-')}" for f in fields if f.type is bool]
    for flag in flags:
        if flag.startswith("--") and flag.split("=")[0] not in known + switches + [
            "--help"
        ]:
            fail(
                f"unknown flag {flag} for {name}; allowed: {', '.join(known)} "
                "(and --no-X for a switch --X)"
            )
    captured = io.StringIO()
    try:  # tyro explains an error in a box of many lines; we keep its one line that says what
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            args = tyro.cli(script.Args, args=flags)
    except SystemExit as exit_:
        if not exit_.code:  # --help
            print(captured.getvalue())
            sys.exit(0)
        lines = [line.strip() for line in captured.getvalue().splitlines()]
        detail = [line for line in lines if line and set(line) != {"-"}][1:2] or [
            "bad flags"
        ]
        fail(f"{name} {shlex.join(flags)}: {detail[0]}")
    try:
        return script, script.check_args(
            args
        )  # with the defaults that depend on the env
    except ValueError as error:
        fail(str(error))


def parse_rejax(flags: list):
    """ppo_nnx.py's Args from flags that rejax's PPO has too."""
    allowed = [f"--{name.replace('_', '-')}" for name in REJAX]
    for flag in flags:
        name = flag.split("=")[0]
        if flag.startswith("--") and name not in allowed + ["--no-anneal-lr"]:
            fail(f"{name} does not apply to rejax; allowed: {', '.join(allowed)}")
    return parse_ours("ppo_nnx", flags)


def parse_floor(flags: list) -> dict:
    settings = dict(FLOOR)
    tokens = [
        t for f in flags for t in (f.split("=", 1) if f.startswith("--") else [f])
    ]
    allowed = ", ".join(f"--{k.replace('_', '-')} N" for k in settings)
    for flag, value in zip(tokens[::2], tokens[1::2] + [None]):
        key = flag[2:].replace("-", "_") if flag.startswith("--") else None
        if key not in settings:
            fail(f"unknown flag {flag} for floor; allowed: {allowed}")
        if value is None or not value.isdigit() or int(value) <= 0:
            fail(f"{flag} for floor takes a positive integer, got {value or 'nothing'}")
        settings[key] = int(value)
    return settings


# ----------------------------------------------------------------------------------------------
# Runs: ours through the script's run(); rejax and the floor compiled and timed here
# ----------------------------------------------------------------------------------------------
def record_ours(script, args, repeats: int) -> dict:
    state, metrics, compile_s, train_s = script.run(args, repeats=repeats)
    final = np.asarray(script.final_return(metrics), dtype=float)
    returns = np.asarray(metrics["charts/episodic_return"])
    steps = args.num_iterations * args.batch_size * args.num_seeds
    return dict(
        args=dataclasses.asdict(args),
        env_steps=steps,
        compile_s=compile_s,
        train_s=train_s,
        seeds=list(range(args.seed, args.seed + args.num_seeds)),
        global_step=np.asarray(metrics["global_step"][0]).tolist(),
        final=final.tolist(),
        mean=float(final.mean()),
        std=float(final.std()),
        # the shortest decimals that give back each float32: exact, and half the size
        episodic_return=[
            [float(str(v)) for v in seed] for seed in returns.astype(np.float32)
        ],
        **(evaluation(script, args, state) if args.eval_episodes else {}),
    )


def evaluation(script, args, state) -> dict:
    """The trained policies evaluated as --eval-episodes does: per seed, the mean and std over its
    episodes; and the mean and std over seeds of those means."""
    returns = script.evaluate(args, state[0], state[2].norm)  # [seed, episode]
    means = returns.mean(1)
    return dict(
        eval_episodes=args.eval_episodes,
        eval_deterministic=args.eval_deterministic,
        eval_return=means.tolist(),
        eval_return_std=returns.std(1).tolist(),
        eval_mean=float(means.mean()),
        eval_std=float(means.std()),
    )


class Gymnax1To5Tuple:
    """gymnax 1.0's env with the 5-value `step` of gymnax before 1.0, which rejax 0.1.3 unpacks,
    and the training return our scripts log: its state also holds the episode's return so far,
    and the returns summed and the count of the episodes it ended.

    The same environment code as ours: terminated | truncated becomes `done`, auto-reset stays.
    """

    def __init__(self, env):
        self._env = env

    def reset(self, key, params=None):
        import jax.numpy as jnp

        obs, state = self._env.reset(key, params)
        return obs, (state, jnp.zeros(()), jnp.zeros(()), jnp.zeros((), int))

    def step(self, key, state, action, params=None):
        state, so_far, summed, ended = state
        obs, state, reward, terminated, truncated, info = self._env.step(
            key, state, action, params
        )
        done, so_far = terminated | truncated, so_far + reward
        state = (state, so_far * ~done, summed + so_far * done, ended + done)
        return obs, state, reward, done, info

    def __getattr__(
        self, name
    ):  # the rest as the env's (not dunders: copy probes them)
        if name.startswith("__") or name == "_env":
            raise AttributeError(name)
        return getattr(self._env, name)


def build_rejax(script, args):
    """rejax's PPO for args.num_seeds seeds, vmapped and compiled, and its argument (the seeds'
    keys). It returns the adapter's returns summed and episodes ended after each iteration,
    [seed, iteration] each."""
    import gymnax
    import jax
    import jax.numpy as jnp
    from rejax import PPO

    env, env_params = gymnax.make(args.env_id)
    updates_per_iteration = args.update_epochs * args.num_minibatches
    of_iteration = script.make_optimizer(args)[
        1
    ]  # ours: the learning rate of iteration i

    algo = PPO.create(
        env=Gymnax1To5Tuple(env),
        env_params=env_params,
        num_envs=args.num_envs,
        num_steps=args.num_steps,
        num_epochs=args.update_epochs,
        num_minibatches=args.num_minibatches,
        total_timesteps=args.num_iterations * args.batch_size,
        learning_rate=lambda count: of_iteration(count // updates_per_iteration),
        gamma=args.gamma,
        gae_lambda=args.gae_lambda,
        clip_eps=args.clip_coef,
        ent_coef=args.ent_coef,
        vf_coef=args.vf_coef,
        max_grad_norm=args.max_grad_norm,
        normalize_observations=args.norm_obs,
        normalize_rewards=args.norm_reward,
        reward_normalization_discount=args.gamma,
        agent_kwargs={
            "activation": args.activation,
            "hidden_layer_sizes": (args.hidden_size, args.hidden_size),
        },
        eval_freq=args.batch_size,
        skip_initial_evaluation=True,
    )  # a "callback" per iteration:
    algo = algo.replace(
        eval_callback=lambda algo, ts, key: (  # the training returns so far
            ts.env_state[2].sum(),
            ts.env_state[3].sum(),
        )
    )
    keys = jax.vmap(jax.random.PRNGKey)(jnp.asarray(args.seeds))
    return jax.jit(jax.vmap(lambda key: algo.train(key)[1])).lower(keys).compile(), keys


def per_iteration(summed, ended) -> np.ndarray:
    """[seed, iteration] mean return of the episodes that ended in each iteration, from the
    adapter's running totals after each one (NaN where none ended, as in our scripts)."""
    summed, ended = (
        np.diff(np.asarray(x, float), prepend=0, axis=1) for x in (summed, ended)
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(ended > 0, summed / ended, np.nan)


def record_rejax(script, args, repeats: int) -> dict:
    """As record_ours, from rejax's PPO: curves of the training return, no evaluation."""
    compile_s, train_s, (summed, ended) = timed(
        lambda: build_rejax(script, args), repeats
    )
    returns = per_iteration(summed, ended)
    final = script.final_return({"charts/episodic_return": returns})
    return dict(
        args=dataclasses.asdict(args),
        env_steps=args.num_iterations * args.batch_size * args.num_seeds,
        compile_s=compile_s,
        train_s=train_s,
        seeds=list(args.seeds),
        global_step=(np.arange(1, args.num_iterations + 1) * args.batch_size).tolist(),
        final=final.tolist(),
        mean=float(final.mean()),
        std=float(final.std()),
        episodic_return=[
            [float(str(v)) for v in seed] for seed in returns.astype(np.float32)
        ],
    )


def build_floor(settings: dict):
    """CartPole stepped with uniformly random actions in one jitted scan: the env's own cost."""
    import gymnax
    import jax

    env, env_params = gymnax.make("CartPole-v1")
    num_envs = settings["num_envs"]
    length = settings["total_timesteps"] // num_envs

    def run(key):
        reset_key, key = jax.random.split(key)
        _, state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(reset_key, num_envs), env_params
        )

        def step(carry, _):
            state, key = carry
            key, action_key, step_key = jax.random.split(key, 3)
            actions = jax.random.randint(action_key, (num_envs,), 0, 2)
            _, state, reward, *_ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(step_key, num_envs), state, actions, env_params
            )
            return (state, key), reward.sum()

        return jax.lax.scan(step, (state, key), length=length)[1].sum()

    key = jax.random.key(0)
    return jax.jit(run).lower(key).compile(), key


def timed(build, repeats: int):
    """(compile seconds, each call's seconds, the last call's output) of build() -> (compiled,
    its argument)."""
    import jax

    start = time.perf_counter()
    compiled, argument = build()
    compile_s, train_s = time.perf_counter() - start, []
    for _ in range(repeats):
        start = time.perf_counter()
        output = jax.block_until_ready(compiled(argument))
        train_s.append(time.perf_counter() - start)
    return compile_s, train_s, output


def record_floor(settings: dict, repeats: int) -> dict:
    compile_s, train_s, _ = timed(lambda: build_floor(settings), repeats)
    steps = settings["total_timesteps"] // settings["num_envs"] * settings["num_envs"]
    return dict(args=settings, env_steps=steps, compile_s=compile_s, train_s=train_s)


def no_nan(value):
    """NaN (no episode ended) as JSON's null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, (list, tuple)):
        return [no_nan(v) for v in value]
    return (
        {k: no_nan(v) for k, v in value.items()} if isinstance(value, dict) else value
    )


def main():
    parser = Parser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed calls of the compiled run"
    )
    parser.add_argument(
        "--name", help="the run's name in the tables (default: its command)"
    )
    parser.add_argument(
        "out", type=Path, metavar="OUT.json", help="the result file to write"
    )
    parser.add_argument(
        "script", metavar="SCRIPT", help="ppo_nnx, ppo_nnx_vae_lstm, rejax, floor"
    )
    parser.add_argument(
        "flags",
        nargs=argparse.REMAINDER,
        metavar="FLAGS",
        help="the script's flags, e.g. --env-id Acrobot-v1 --num-seeds 8",
    )
    options = parser.parse_args()
    scripts = OURS + ("rejax", "floor")
    if options.script not in scripts:
        fail(f"unknown SCRIPT {options.script!r}; choose one of {', '.join(scripts)}")
    if options.repeats < 1:
        fail(f"--repeats must be at least 1, got {options.repeats}")

    command = shlex.join(["python", "benchmarks/record.py", *sys.argv[1:]])
    if options.script in OURS:
        command = shlex.join(["python", f"{options.script}.py", *options.flags])
        result = record_ours(
            *parse_ours(options.script, options.flags), options.repeats
        )
    elif options.script == "rejax":
        result = record_rejax(*parse_rejax(options.flags), options.repeats)
    else:
        result = record_floor(parse_floor(options.flags), options.repeats)
    name = options.name or command
    record = dict(
        name=name,
        command=command,
        date=datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        machine=machine(),
        versions=versions(),
        script=options.script,
        flags=options.flags,
        **result,
    )
    options.out.parent.mkdir(parents=True, exist_ok=True)
    partial = options.out.with_name(options.out.name + ".partial")
    lines = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in no_nan(record).items()]
    partial.write_text(
        "{\n" + ",\n".join(lines) + "\n}\n"
    )  # a key a line, lists on one
    os.replace(partial, options.out)  # a run killed while writing leaves no half file
    train_s = statistics.median(record["train_s"])
    print(
        f"{name}: compile {record['compile_s']:.1f} s, train {train_s:.2f} s, "
        f"{record['env_steps'] / train_s:,.0f} env steps/s"
        + (
            f", final return {record['mean']:.1f} ± {record['std']:.1f}"
            if "mean" in record
            else ""
        )
        + (
            f", eval return {record['eval_mean']:.1f} ± {record['eval_std']:.1f}"
            if "eval_mean" in record
            else ""
        )
        + f" -> {options.out}"
    )


if __name__ == "__main__":
    main()
