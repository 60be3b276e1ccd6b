"""Throughput of training as a host loop over compiled chunks, beside one compiled call.

    python benchmarks/chunks.py [--rounds 5] [--against REV] [--out results/chunks.md]

Each configuration trains `ppo_nnx.py` at CleanRL's CartPole settings (4 envs x 128 steps, 4
epochs of 4 minibatches) in a process of its own, compiles once and times 3 whole runs through
the script's `run`; rounds alternate the configurations, so a slow minute on a noisy machine
hits all of them alike. Configurations, for 1 seed (500k steps) and 8 vmapped seeds (200k each):

- `chunks`: the script as it is, its default chunks (about a second of training per call);
- `one call`: the same script with `--chunk-iterations` the whole run, nothing on the host
  between iterations;
- `REV`: `ppo_nnx.py` as git holds it at REV (`--against`; none by default), trained the way
  that revision trains.

The table gives medians over every timed run, and the ratios of env steps per second.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import describe, machine, versions

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = dict(num_envs=4, num_steps=128, update_epochs=4, num_minibatches=4)
SEEDS = {1: 500_000, 8: 200_000}  # seeds: env steps per seed


def child(folder: str, flags: dict) -> None:
    """In this process: compile the script in `folder`, time 3 runs, print one JSON line."""
    sys.path.insert(0, folder)
    import ppo_nnx

    args = ppo_nnx.Args(**flags)
    *_, compile_s, train_s = ppo_nnx.run(args, repeats=3)
    steps = args.num_iterations * args.batch_size * args.num_seeds
    print(json.dumps(dict(compile_s=compile_s, train_s=train_s, env_steps=steps)))


def measure(folder: Path, flags: dict) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--child", str(folder), json.dumps(flags)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--against", metavar="REV", help="a git revision of ppo_nnx.py to time"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/chunks.md"
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        return child(options.child[0], json.loads(options.child[1]))

    folders = {"chunks": ROOT, "one call": ROOT}
    if options.against:
        other = Path(tempfile.mkdtemp()) / options.against
        other.mkdir(parents=True)
        (other / "ppo_nnx.py").write_bytes(
            subprocess.run(
                ["git", "show", f"{options.against}:ppo_nnx.py"],
                cwd=ROOT,
                capture_output=True,
                check=True,
            ).stdout
        )
        folders[options.against] = other
    runs = {}
    for k in range(options.rounds):
        for seeds, steps in SEEDS.items():
            for name, folder in folders.items():
                flags = dict(SETTINGS, num_seeds=seeds, total_timesteps=steps)
                if name == "one call":
                    flags["chunk_iterations"] = steps // (4 * 128)
                result = measure(folder, flags)
                runs.setdefault((name, seeds), []).append(result)
                print(
                    f"round {k + 1}, {name}, {seeds} seed(s): "
                    f"{result['env_steps'] / statistics.median(result['train_s']):,.0f} "
                    "env steps/s",
                    flush=True,
                )

    def rate(name, seeds):  # the median over every timed run of every round
        results = runs[name, seeds]
        return results[0]["env_steps"] / statistics.median(
            [t for result in results for t in result["train_s"]]
        )

    flags = os.environ.get("XLA_FLAGS")  # fake CPU devices, when set
    lines = [
        "# Training in chunks beside one compiled call",
        "",
        "`"
        + (f"XLA_FLAGS={flags} " if flags else "")
        + f"python benchmarks/chunks.py --rounds {options.rounds}"
        + (f" --against {options.against}`" if options.against else "`")
        + f", on {describe(machine(), versions())}. "
        f"{options.rounds} rounds of alternating processes, 3 timed runs per process; "
        "CleanRL's CartPole settings (4 envs x 128 steps, 4 epochs, 4 minibatches); "
        "medians over all runs.",
        "",
        "| configuration | seeds | env steps/s | compile (s) | / chunks |",
        "| --- | --- | --- | --- | --- |",
    ]
    for seeds in SEEDS:
        for name in folders:
            compile_s = statistics.median(r["compile_s"] for r in runs[name, seeds])
            lines.append(
                f"| {name} | {seeds} | {rate(name, seeds):,.0f} | {compile_s:.1f} | "
                f"{rate(name, seeds) / rate('chunks', seeds):.3f} |"
            )
    options.out.write_text("\n".join(lines) + "\n")
    print(f"-> {options.out}")


if __name__ == "__main__":
    main()
