"""The benchmark scripts still run (tiny budgets); their figures are measured outside the tests."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_speed_benchmark_quick_run(tmp_path):
    names = ["ppo_nnx", "random actions (floor)"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "speed.py"), "--quick", "--rounds", "1",
         "--repeats", "1", "--out", str(tmp_path), "--only", *names],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "speed.json").read_text())
    assert list(report["table"]) == names
    for name in names:
        row = report["table"][name]
        assert "error" not in row, row
        assert row["env_steps"] >= 1024 and row["sps"] > 0 and row["compile_s"] > 0
    assert report["machine"]["cores"] >= 1 and report["versions"]["jax"]
    table = (tmp_path / "speed.md").read_text()
    assert table.startswith("# Speed") and "| ppo_nnx |" in table
