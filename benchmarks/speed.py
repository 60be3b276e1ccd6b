"""Speed of the compiled train functions, side by side with rejax's PPO, on this machine.

    pip install -r benchmarks/requirements.txt
    python benchmarks/speed.py                  # about 15 min on a 2-core CPU
    python benchmarks/speed.py --quick          # a smoke run with tiny budgets

Every configuration runs in its own process, and the processes alternate round by round, so
that a slow minute on a noisy machine hits every configuration alike. Each process compiles once
and times `--repeats` calls of the compiled program; the tables report medians over all calls.
Writes results/speed.json and results/speed.md.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# CleanRL's CartPole settings, shared by ppo_nnx.py's defaults and the rejax run below.
CLEANRL = dict(num_envs=4, num_steps=128, update_epochs=4, num_minibatches=4,
               total_timesteps=500_000)

# name -> (what runs, its settings); "steps" is per seed.
CONFIGS = {
    "ppo_nnx": ("ppo_nnx", dict(CLEANRL)),
    "rejax": ("rejax", dict(CLEANRL)),
    "ppo_nnx 64 envs": ("ppo_nnx", dict(CLEANRL, num_envs=64)),
    "rejax 64 envs": ("rejax", dict(CLEANRL, num_envs=64)),
    "ppo_nnx 8 seeds": ("ppo_nnx", dict(CLEANRL, num_seeds=8, total_timesteps=200_000)),
    "ppo_nnx 32 seeds": ("ppo_nnx", dict(CLEANRL, num_seeds=32, total_timesteps=100_000)),
    "ppo_nnx_vae_lstm defaults": ("ppo_nnx_vae_lstm", dict(total_timesteps=500_000)),
    "ppo_nnx_vae_lstm at ppo_nnx settings": ("ppo_nnx_vae_lstm", dict(CLEANRL)),
    "ppo_nnx at ppo_nnx_vae_lstm settings": (
        "ppo_nnx", dict(num_envs=32, num_steps=32, total_timesteps=500_000)),
    "random actions (floor)": ("floor", dict(num_envs=4, total_timesteps=500_000)),
}


# ----------------------------------------------------------------------------------------------
# Workers: one configuration, in this process
# ----------------------------------------------------------------------------------------------
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


def build_ours(module_name: str, settings: dict):
    """(compiled train, its argument, env steps per call) for ppo_nnx or ppo_nnx_vae_lstm."""
    import importlib

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(ROOT))
    script = importlib.import_module(module_name)
    args = script.Args(**settings)
    train = script.make_train(args)
    if args.num_seeds == 1:  # as main runs one seed: not vmapped
        key = jax.random.key(0)
        return jax.jit(train).lower(key).compile(), key, args.num_iterations * args.batch_size
    keys = jax.vmap(jax.random.key)(jnp.arange(args.num_seeds))
    compiled = jax.jit(jax.vmap(train)).lower(keys).compile()
    return compiled, keys, args.num_iterations * args.batch_size * args.num_seeds


def build_rejax(settings: dict):
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


def worker(name: str, settings: dict, repeats: int) -> dict:
    """Compile once, time `repeats` calls; everything in seconds."""
    import jax

    kind = CONFIGS[name][0]
    start = time.perf_counter()
    if kind == "rejax":
        compiled, argument, steps = build_rejax(settings)
    elif kind == "floor":
        compiled, argument, steps = build_floor(settings)
    else:
        compiled, argument, steps = build_ours(kind, settings)
    compile_s = time.perf_counter() - start
    run_s = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(argument))
        run_s.append(time.perf_counter() - start)
    return dict(compile_s=compile_s, run_s=run_s, env_steps=steps)


# ----------------------------------------------------------------------------------------------
# Driver: alternating processes, medians, tables
# ----------------------------------------------------------------------------------------------
def versions() -> dict:
    from importlib import metadata

    found = {}
    for package in ("jax", "jaxlib", "flax", "optax", "gymnax", "rejax"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def machine() -> dict:
    model = platform.processor()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import jax
    return dict(cpu=model, cores=os.cpu_count(), devices=[str(d) for d in jax.devices()],
                python=platform.python_version())


def describe(info: dict, found: dict) -> str:
    """The machine and the versions, for the header of a results table."""
    return (f"{info['cpu']} ({info['cores']} cores), devices {', '.join(info['devices'])}, "
            f"Python {info['python']}; "
            + ", ".join(f"{k} {v}" for k, v in found.items() if v))


def run_round(names, settings_of, repeats, timeout_s) -> dict:
    results = {}
    for name in names:
        command = [sys.executable, __file__, "--worker", name,
                   "--settings", json.dumps(settings_of[name]), "--repeats", str(repeats)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            results[name] = dict(error=f"hung: no result within {timeout_s} s")
        else:
            if done.returncode == 0:
                results[name] = json.loads(done.stdout.strip().splitlines()[-1])
            else:
                lines = done.stderr.strip().splitlines()
                results[name] = dict(error=lines[-1][:300] if lines
                                     else f"exit code {done.returncode}")
        print(f"  {name}: {summary_line(results[name])}", flush=True)
    return results


def summary_line(result: dict) -> str:
    if "error" in result:
        return "error: " + result["error"]
    run = statistics.median(result["run_s"])
    return (f"compile {result['compile_s']:.1f} s, run {run:.2f} s, "
            f"{result['env_steps'] / run:,.0f} env steps/s")


def aggregate(rounds: list, names: list) -> dict:
    table = {}
    for name in names:
        good = [r[name] for r in rounds if "error" not in r[name]]
        if not good:
            table[name] = dict(error=rounds[-1][name]["error"])
            continue
        run_s = [t for r in good for t in r["run_s"]]
        steps = good[0]["env_steps"]
        table[name] = dict(
            env_steps=steps, compile_s=statistics.median(r["compile_s"] for r in good),
            run_s=statistics.median(run_s), sps=statistics.median(steps / t for t in run_s),
            sps_per_round=[statistics.median(steps / t for t in r["run_s"]) for r in good])
    return table


def ratio(table, a, b, key="sps"):
    if key in table.get(a, {}) and key in table.get(b, {}):
        return table[a][key] / table[b][key]
    return None


def markdown(report: dict) -> str:
    table, info = report["table"], report["machine"]
    lines = [
        "# Speed of the compiled train functions",
        "",
        f"Measured {report['date']} on {describe(info, report['versions'])}.",
        f"{report['rounds']} rounds of alternating processes, {report['repeats']} timed calls "
        "per process; medians over all calls. Compile time is the median over rounds.",
        "",
        "| configuration | settings | env steps per call | compile (s) | run (s) | env steps/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in table.items():
        settings = ", ".join(f"{k}={v}" for k, v in report["settings"][name].items())
        if "error" in row:
            lines.append(f"| {name} | {settings} | | | | {row['error']} |")
        else:
            lines.append(f"| {name} | {settings} | {row['env_steps']:,} | {row['compile_s']:.1f} "
                         f"| {row['run_s']:.2f} | {row['sps']:,.0f} |")
    lines += ["", "| ratio | value |", "| --- | --- |"]
    for label, value in report["ratios"].items():
        lines.append(f"| {label} | {'n/a' if value is None else f'{value:.2f}'} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per process")
    parser.add_argument("--only", nargs="*", choices=list(CONFIGS), help="a subset of configs")
    parser.add_argument("--quick", action="store_true", help="tiny budgets: a smoke run")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds per process; a run past it is reported as hung")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(worker(options.worker, json.loads(options.settings), options.repeats)))
        return

    names = options.only or list(CONFIGS)
    settings_of = {}
    for name in names:
        settings = dict(CONFIGS[name][1])
        if options.quick:  # two iterations of each, at most 2 seeds
            settings["total_timesteps"] = (2 * settings.get("num_envs", 32)
                                           * settings.get("num_steps", 128))
            if "num_seeds" in settings:
                settings["num_seeds"] = 2
        settings_of[name] = settings
    rounds = []
    for index in range(options.rounds):
        print(f"round {index + 1} of {options.rounds}", flush=True)
        rounds.append(run_round(names, settings_of, options.repeats, options.timeout))

    table = aggregate(rounds, names)
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine(), versions=versions(), rounds=options.rounds, repeats=options.repeats,
        quick=options.quick, settings=settings_of, table=table, raw=rounds,
        ratios={
            "ppo_nnx / rejax, CleanRL CartPole settings": ratio(table, "ppo_nnx", "rejax"),
            "ppo_nnx / rejax compile time": ratio(table, "ppo_nnx", "rejax", "compile_s"),
            "ppo_nnx / rejax, 64 envs": ratio(table, "ppo_nnx 64 envs", "rejax 64 envs"),
            "8 seeds / 1 seed (aggregate env steps/s)": ratio(table, "ppo_nnx 8 seeds", "ppo_nnx"),
            "32 seeds / 1 seed (aggregate env steps/s)": ratio(table, "ppo_nnx 32 seeds",
                                                               "ppo_nnx"),
            "ppo_nnx / ppo_nnx_vae_lstm, both at 32 envs x 32 steps": ratio(
                table, "ppo_nnx at ppo_nnx_vae_lstm settings", "ppo_nnx_vae_lstm defaults"),
            "random-action floor / ppo_nnx": ratio(table, "random actions (floor)", "ppo_nnx"),
        })
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "speed.json").write_text(json.dumps(report, indent=1))
    (options.out / "speed.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
