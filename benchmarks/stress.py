"""Hang check: run the vmapped multi-seed program K times, each in its own watched process.

    python benchmarks/stress.py                        # 20 runs of the README's 5-seed snippet
    python benchmarks/stress.py --entry cli --seeds 8 --runs 5   # python ppo_nnx.py --num-seeds 8

A deadlocked XLA program does not crash: it sits at 0% CPU forever. So each run is a process of
its own under a watchdog that reads the process's CPU time from /proc once a second and calls the
run hung, and kills it, when that time has not moved for --idle-timeout seconds. Nothing here
sets XLA_FLAGS: the runs see the environment a user has. Writes results/stress.md and .json
(--name changes the file name).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from common import describe, machine, versions  # noqa: E402

# The README's "Train several seeds at once" snippet, with its sizes as parameters.
SNIPPET = """
import sys, jax, numpy as np
sys.path.insert(0, {root!r})
import {script} as P
args = P.Args(env_id={env_id!r}, total_timesteps={steps})
train = jax.jit(jax.vmap(P.make_train(args)))
final_state, metrics = train(jax.vmap(jax.random.key)(np.arange({seeds})))
print("final_return", P.final_return(metrics).round(1).tolist())
"""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = (
            f.read().rsplit(")", 1)[1].split()
        )  # after "(comm)", which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def watch(command: list, idle_timeout: float, limit: float) -> dict:
    """Run `command`; kill it once its CPU time stands still for `idle_timeout` s (a hang)."""
    start = time.monotonic()
    log = tempfile.TemporaryFile(
        "w+"
    )  # not a pipe: a full pipe would stall the run, not XLA
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    last_cpu, last_move, outcome = 0.0, start, None
    while process.poll() is None:
        time.sleep(1.0)
        now = time.monotonic()
        try:
            cpu = cpu_seconds(process.pid)
        except (OSError, IndexError):  # exited between poll() and the read
            continue
        if cpu > last_cpu + 0.01:
            last_cpu, last_move = cpu, now
        if now - last_move >= idle_timeout:
            outcome = "hung"
        elif now - start >= limit:
            outcome = "too slow"
        if outcome:
            process.kill()
            break
    process.wait()
    log.seek(0)
    output = log.read()
    if outcome is None:
        outcome = "ok" if process.returncode == 0 else "failed"
    tail = output.strip().splitlines()[-1:] or [""]
    return dict(
        outcome=outcome,
        wall_s=round(time.monotonic() - start, 1),
        cpu_s=round(last_cpu, 1),
        exit_code=process.returncode,
        last_line=tail[0][:300],
    )


def command_for(options) -> list:
    if options.entry == "cli":
        return [
            sys.executable,
            str(ROOT / f"{options.script}.py"),
            "--env-id",
            options.env_id,
            "--total-timesteps",
            str(options.total_timesteps),
            "--num-seeds",
            str(options.seeds),
        ]
    code = SNIPPET.format(
        root=str(ROOT),
        script=options.script,
        env_id=options.env_id,
        steps=options.total_timesteps,
        seeds=options.seeds,
    )
    return [sys.executable, "-c", code]


def markdown(report: dict) -> str:
    counts = report["counts"]
    lines = [
        "# Hang check: vmapped seeds, each run in its own watched process",
        "",
        f"Measured {report['date']} on {describe(report['machine'], report['versions'])}.",
        f"XLA_FLAGS: {report['xla_flags'] or '(not set)'}.",
        "",
        f"Program: {report['program']}. A run is *hung* when its process used no CPU for "
        f"{report['idle_timeout']} s.",
        "",
        f"**{counts.get('hung', 0)} hung in {report['runs']} runs** "
        f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}).",
        "",
        "| run | outcome | wall (s) | CPU (s) | last line |",
        "| --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(report["results"], 1):
        last = r["last_line"].replace("|", "/")
        lines.append(
            f"| {i} | {r['outcome']} | {r['wall_s']} | {r['cpu_s']} | {last} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs", type=int, default=20, help="K: how many processes, one by one"
    )
    parser.add_argument("--seeds", type=int, default=5, help="vmapped seeds per run")
    parser.add_argument("--total-timesteps", type=int, default=200_000, help="per seed")
    parser.add_argument("--env-id", default="CartPole-v1")
    parser.add_argument(
        "--script", default="ppo_nnx", choices=["ppo_nnx", "ppo_nnx_vae_lstm"]
    )
    parser.add_argument(
        "--entry",
        default="snippet",
        choices=["snippet", "cli"],
        help="the README's jax.vmap(make_train(args)) snippet, or the CLI's "
        "--num-seeds",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=30.0,
        help="seconds without CPU use that make a run hung",
    )
    parser.add_argument(
        "--limit", type=float, default=900.0, help="seconds per run at most"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument(
        "--name", default="stress", help="writes OUT/NAME.md and OUT/NAME.json"
    )
    options = parser.parse_args()
    for name in ("runs", "seeds", "total_timesteps", "idle_timeout", "limit"):
        if getattr(options, name) <= 0:
            parser.error(
                f"--{name.replace('_', '-')} must be positive, "
                f"got {getattr(options, name)}"
            )

    command = command_for(options)
    program = (
        f"`{options.script}.py --num-seeds {options.seeds}`"
        if options.entry == "cli"
        else f"`jax.jit(jax.vmap({options.script}.make_train(args)))`, "
        f"{options.seeds} seeds"
    )
    program += f", {options.env_id}, {options.total_timesteps:,} env steps per seed"
    results = []
    for i in range(options.runs):
        result = watch(command, options.idle_timeout, options.limit)
        results.append(result)
        print(
            f"run {i + 1}/{options.runs}: {result['outcome']} in {result['wall_s']} s "
            f"({result['cpu_s']} s CPU)  {result['last_line']}",
            flush=True,
        )
    counts = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        machine=machine(),
        versions=versions(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        program=program,
        command=command,
        idle_timeout=options.idle_timeout,
        runs=options.runs,
        counts=counts,
        results=results,
    )
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / f"{options.name}.json").write_text(json.dumps(report, indent=1))
    (options.out / f"{options.name}.md").write_text(markdown(report))
    print(f"{counts.get('hung', 0)} hung in {options.runs} runs: {counts}")
    return 0 if counts.get("ok", 0) == options.runs else 1


if __name__ == "__main__":
    sys.exit(main())
