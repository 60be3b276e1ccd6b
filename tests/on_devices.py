"""`python tests/on_devices.py SCRIPT OUT.npz RUN_JSON...`: each run's final parameters and metrics,
in a process whose device count the caller set (XLA_FLAGS) before jax started.

A run is `{"args": {...}, "bug": null | "local_moments" | "module_rng"}`: the bugs are the
negative controls, put in by replacing a name in the script module.
"""

import importlib
import json
import sys
from pathlib import Path

import jax
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).parent)]
from conftest import module_rng_bottleneck  # noqa: E402

script = importlib.import_module(sys.argv[1])
bugs = {
    "local_moments": (
        "moments",
        lambda x: (x[: len(x) // 4].mean(0), x[: len(x) // 4].var(0)),
    ),  # one of 4 devices' envs
    "module_rng": ("VariationalBottleneck", module_rng_bottleneck(script)),
}
results = {}
for i, run in enumerate(map(json.loads, sys.argv[3:])):
    if run["bug"]:
        name, value = bugs[run["bug"]]
        saved, _ = getattr(script, name), setattr(script, name, value)
    state, metrics, *_ = script.run(script.Args(**run["args"]))
    params = state.params
    if run["bug"]:
        setattr(script, name, saved)
    results.update(
        {f"{i} param {j}": np.asarray(x) for j, x in enumerate(jax.tree.leaves(params))}
    )
    results.update({f"{i} metric {k}": np.asarray(v) for k, v in metrics.items()})
np.savez(sys.argv[2], **results)
