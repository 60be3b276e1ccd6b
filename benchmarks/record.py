"""One benchmark run, in this process, written to one JSON file.

    python benchmarks/record.py [--repeats N] [--name NAME] OUT.json SCRIPT [FLAGS...]

SCRIPT is ppo_nnx or ppo_nnx_vae_lstm (FLAGS: the script's own command-line flags; the script's
`run` compiles and times it), rejax (rejax 0.1.3's PPO on gymnax's CartPole-v1) or floor
(CartPole-v1 stepped with random actions: the env's own cost), which take the flags of ours that
apply to them. learning.sh and speed.sh list the runs; report.py makes tables and plots of them.
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
# The flags rejax and the floor take, and their defaults: CleanRL's CartPole settings.
OTHERS = {
    "rejax": dict(num_envs=4, num_steps=128, update_epochs=4, num_minibatches=4,
                  total_timesteps=500_000),
    "floor": dict(num_envs=4, total_timesteps=500_000),
}


def fail(message: str):
    print(f"record.py: error: {message}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        fail(f"{message} (usage: record.py [--repeats N] [--name NAME] OUT.json SCRIPT [FLAGS])")


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
        if flag.startswith("--") and flag.split("=")[0] not in known + switches + ["--help"]:
            fail(f"unknown flag {flag} for {name}; allowed: {', '.join(known)} "
                 "(and --no-X for a switch --X)")
    captured = io.StringIO()
    try:  # tyro explains an error in a box of many lines; we keep its one line that says what
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            args = tyro.cli(script.Args, args=flags)
    except SystemExit as exit_:
        if not exit_.code:  # --help
            print(captured.getvalue())
            sys.exit(0)
        lines = [line.strip() for line in captured.getvalue().splitlines()]
        detail = [line for line in lines if line and set(line) != {"-"}][1:2] or ["bad flags"]
        fail(f"{name} {shlex.join(flags)}: {detail[0]}")
    try:
        return script, script.check_args(args)  # with the defaults that depend on the env
    except ValueError as error:
        fail(str(error))


def parse_others(name: str, flags: list) -> dict:
    settings = dict(OTHERS[name])
    tokens = [t for f in flags for t in (f.split("=", 1) if f.startswith("--") else [f])]
    allowed = ", ".join(f"--{k.replace('_', '-')} N" for k in settings)
    for flag, value in zip(tokens[::2], tokens[1::2] + [None]):
        key = flag[2:].replace("-", "_") if flag.startswith("--") else None
        if key not in settings:
            fail(f"unknown flag {flag} for {name}; allowed: {allowed}")
        if value is None or not value.isdigit() or int(value) <= 0:
            fail(f"{flag} for {name} takes a positive integer, got {value or 'nothing'}")
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
        args=dataclasses.asdict(args), env_steps=steps, compile_s=compile_s, train_s=train_s,
        seeds=list(range(args.seed, args.seed + args.num_seeds)),
        global_step=np.asarray(metrics["global_step"][0]).tolist(),
        final=final.tolist(), mean=float(final.mean()), std=float(final.std()),
        # the shortest decimals that give back each float32: exact, and half the size
        episodic_return=[[float(str(v)) for v in seed] for seed in returns.astype(np.float32)],
        **(evaluation(script, args, state) if args.eval_episodes else {}))


def evaluation(script, args, state) -> dict:
    """The trained policies evaluated as --eval-episodes does: per seed, the mean and std over its
    episodes; and the mean and std over seeds of those means."""
    returns = script.evaluate(args, state[0], state[2].norm)  # [seed, episode]
    means = returns.mean(1)
    return dict(eval_episodes=args.eval_episodes, eval_deterministic=args.eval_deterministic,
                eval_return=means.tolist(), eval_return_std=returns.std(1).tolist(),
                eval_mean=float(means.mean()), eval_std=float(means.std()))


class Gymnax1To5Tuple:
    """gymnax 1.0's env with the old 5-value `step` that rejax 0.1.3 unpacks.

    The same environment code as ours: terminated | truncated becomes `done`, auto-reset stays.
    """

    def __init__(self, env):
        self._env = env

    def step(self, key, state, action, params=None):
        obs, state, reward, terminated, truncated, info = self._env.step(key, state, action,
                                                                         params)
        return obs, state, reward, terminated | truncated, info

    def __getattr__(self, name):  # the rest as the env's (not dunders: copy probes them)
        if name.startswith("__") or name == "_env":
            raise AttributeError(name)
        return getattr(self._env, name)


def build_rejax(settings: dict):
    """(compiled train, its argument, env steps per call) for rejax's PPO, evaluation off."""
    import gymnax
    import jax
    import jax.numpy as jnp
    from rejax import PPO

    env, env_params = gymnax.make("CartPole-v1")
    steps = settings["total_timesteps"]
    algo = PPO.create(
        env=Gymnax1To5Tuple(env), env_params=env_params, num_envs=settings["num_envs"],
        num_steps=settings["num_steps"], num_epochs=settings["update_epochs"],
        num_minibatches=settings["num_minibatches"], total_timesteps=steps,
        learning_rate=2.5e-4, gamma=0.99, gae_lambda=0.95, clip_eps=0.2, ent_coef=0.01,
        vf_coef=0.5, max_grad_norm=0.5,
        agent_kwargs={"activation": "tanh", "hidden_layer_sizes": (64, 64)},
        eval_freq=steps, skip_initial_evaluation=True)  # one eval block, made a no-op below
    algo = algo.replace(eval_callback=lambda algo, train_state, key: jnp.zeros(()))
    key = jax.random.PRNGKey(0)
    compiled = jax.jit(algo.train).lower(key).compile()
    batch = settings["num_envs"] * settings["num_steps"]
    return compiled, key, -(-steps // batch) * batch


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
            jax.random.split(reset_key, num_envs), env_params)

        def step(carry, _):
            state, key = carry
            key, action_key, step_key = jax.random.split(key, 3)
            actions = jax.random.randint(action_key, (num_envs,), 0, 2)
            _, state, reward, *_ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(step_key, num_envs), state, actions, env_params)
            return (state, key), reward.sum()

        return jax.lax.scan(step, (state, key), length=length)[1].sum()

    key = jax.random.key(0)
    return jax.jit(run).lower(key).compile(), key, length * num_envs


def record_other(name: str, settings: dict, repeats: int) -> dict:
    import jax

    start = time.perf_counter()
    compiled, argument, steps = (build_rejax if name == "rejax" else build_floor)(settings)
    compile_s, train_s = time.perf_counter() - start, []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(argument))
        train_s.append(time.perf_counter() - start)
    return dict(args=settings, env_steps=steps, compile_s=compile_s, train_s=train_s)


def no_nan(value):
    """NaN (no episode ended) as JSON's null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, (list, tuple)):
        return [no_nan(v) for v in value]
    return {k: no_nan(v) for k, v in value.items()} if isinstance(value, dict) else value


def main():
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1, help="timed calls of the compiled run")
    parser.add_argument("--name", help="the run's name in the tables (default: its command)")
    parser.add_argument("out", type=Path, metavar="OUT.json", help="the result file to write")
    parser.add_argument("script", metavar="SCRIPT", help="ppo_nnx, ppo_nnx_vae_lstm, rejax, floor")
    parser.add_argument("flags", nargs=argparse.REMAINDER, metavar="FLAGS",
                        help="the script's flags, e.g. --env-id Acrobot-v1 --num-seeds 8")
    options = parser.parse_args()
    scripts = OURS + tuple(OTHERS)
    if options.script not in scripts:
        fail(f"unknown SCRIPT {options.script!r}; choose one of {', '.join(scripts)}")
    if options.repeats < 1:
        fail(f"--repeats must be at least 1, got {options.repeats}")

    if options.script in OURS:
        command = shlex.join(["python", f"{options.script}.py", *options.flags])
        script, args = parse_ours(options.script, options.flags)
        result = record_ours(script, args, options.repeats)
    else:
        command = shlex.join(["python", "benchmarks/record.py", *sys.argv[1:]])
        settings = parse_others(options.script, options.flags)
        result = record_other(options.script, settings, options.repeats)
    name = options.name or command
    record = dict(
        name=name, command=command,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine(), versions=versions(), script=options.script, flags=options.flags,
        **result)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    partial = options.out.with_name(options.out.name + ".partial")
    lines = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in no_nan(record).items()]
    partial.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # a key a line, lists on one
    os.replace(partial, options.out)  # a run killed while writing leaves no half file
    train_s = statistics.median(record["train_s"])
    print(f"{name}: compile {record['compile_s']:.1f} s, train {train_s:.2f} s, "
          f"{record['env_steps'] / train_s:,.0f} env steps/s"
          + (f", final return {record['mean']:.1f} ± {record['std']:.1f}"
             if "mean" in record else "")
          + (f", eval return {record['eval_mean']:.1f} ± {record['eval_std']:.1f}"
             if "eval_mean" in record else "") + f" -> {options.out}")


if __name__ == "__main__":
    main()
