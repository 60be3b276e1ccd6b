"""A --sweep in one process beside the same configurations as separate processes, end to end.

    python benchmarks/sweep.py [--rounds 3] [--out results/sweep.md]

Eight learning rates at CleanRL's CartPole settings (the defaults of `ppo_nnx.py`: 500k steps,
4 envs x 128 steps), one seed each:

- `sweep`: `python ppo_nnx.py --sweep learning-rate=<8 values>`, one process, one compile;
- `separate`: `python ppo_nnx.py --learning-rate <value>` for each value, 8 processes one after
  another, as a launcher of one process per configuration runs them (W&B sweep agents,
  CleanRL's tuner).

Rounds alternate the two. Wall time is each command's, start-up, imports and compiling
included. Env steps/s are the `summary:` line's (training only): the sweep's aggregate against
the median of the separate runs'.
"""

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import describe, machine, versions

ROOT = Path(__file__).resolve().parents[1]
RATES = ["1e-4", "2.5e-4", "5e-4", "7.5e-4", "1e-3", "2.5e-3", "5e-3", "1e-2"]


def timed(flags: list) -> tuple[float, dict]:
    """Wall seconds of `python ppo_nnx.py flags...` and its summary's numbers."""
    begin = time.time()
    result = subprocess.run(
        [sys.executable, str(ROOT / "ppo_nnx.py"), *flags],
        cwd=tempfile.mkdtemp(),  # its runs/ folder
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    seconds = time.time() - begin
    summary = next(x for x in result.stdout.splitlines() if x.startswith("summary:"))
    numbers = dict(re.findall(r"(compile_s|train_s|SPS)=([\d,.]+)", summary))
    return seconds, {k: float(v.replace(",", "")) for k, v in numbers.items()}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/sweep.md"
    )
    options = parser.parse_args()
    sweep, separate = [], []  # (wall seconds, summary) of each command
    for k in range(options.rounds):
        sweep.append(timed(["--sweep", "learning-rate=" + ",".join(RATES)]))
        print(f"round {k + 1}, sweep: {sweep[-1][0]:.1f} s", flush=True)
        for rate in RATES:
            separate.append(timed(["--learning-rate", rate]))
            print(f"round {k + 1}, --learning-rate {rate}: {separate[-1][0]:.1f} s")

    def median(runs, key):
        return statistics.median(summary[key] for _, summary in runs)

    sweep_s = statistics.median(seconds for seconds, _ in sweep)
    rounds = [separate[i : i + len(RATES)] for i in range(0, len(separate), len(RATES))]
    separate_s = statistics.median(sum(s for s, _ in r) for r in rounds)
    one_s = statistics.median(seconds for seconds, _ in separate)
    lines = [
        "# A sweep in one process beside separate processes",
        "",
        f"`python benchmarks/sweep.py --rounds {options.rounds}`, on "
        f"{describe(machine(), versions())}. Eight learning rates "
        f"({', '.join(RATES)}) at CleanRL's CartPole settings (500k steps each, 4 envs x "
        "128 steps, 1 seed); rounds alternate the one `--sweep` process and the 8 processes "
        "run one after another; medians over the rounds.",
        "",
        "| | wall s (start-up and compile included) | compile s | env steps/s (training) |",
        "| --- | --- | --- | --- |",
        f"| `--sweep`, 8 configurations, one process | {sweep_s:.1f} | "
        f"{median(sweep, 'compile_s'):.1f} | {median(sweep, 'SPS'):,.0f} |",
        f"| 8 separate processes, one after another | {separate_s:.1f} | "
        f"{median(separate, 'compile_s'):.1f} each | {median(separate, 'SPS'):,.0f} each |",
        f"| one of them | {one_s:.1f} | | |",
        "",
        f"- End to end, the sweep takes {sweep_s / separate_s:.2f} of the separate "
        f"processes' time ({separate_s / sweep_s:.2f}x faster).",
        f"- Its aggregate env steps/s are {median(sweep, 'SPS') / median(separate, 'SPS'):.2f}"
        " times one run's.",
    ]
    options.out.write_text("\n".join(lines) + "\n")
    print(f"-> {options.out}")


if __name__ == "__main__":
    main()
