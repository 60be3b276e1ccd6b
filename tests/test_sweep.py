"""--sweep: a grid of hyperparameters times seeds, trained in one compiled program. A configuration
of a sweep trains as its flags given alone; every run is logged, ranked, saved and reloaded; what
would change the program is refused in one line."""

import dataclasses
import re

import numpy as np
import pytest
import wandb

import ppo_nnx
from conftest import same_run, tiny_args, train

# every sweepable value off its default, and two learning rates: configurations (1e-3, ...) and
# (3e-3, ...)
SWEEP = (
    "learning-rate=1e-3,3e-3",
    "gamma=0.95",
    "gae-lambda=0.9",
    "clip-coef=0.3",
    "ent-coef=0.02",
    "vf-coef=0.4",
    "max-grad-norm=0.3",
    "kl-coef=0.01",
)
SECOND = dict(
    learning_rate=3e-3,
    gamma=0.95,
    gae_lambda=0.9,
    clip_coef=0.3,
    ent_coef=0.02,
    vf_coef=0.4,
    max_grad_norm=0.3,
    kl_coef=0.01,
)


@pytest.fixture(scope="module", params=["ppo_nnx", "ppo_nnx_vae_lstm"])
def sweep_runs(request):
    """20 iterations of the 2 configurations x seeds 1, 2 (4 runs, vmapped), and of the second
    configuration's flags given alone with --seed 2."""
    script = __import__(request.param)
    args = tiny_args(script, total_timesteps=4 * 32 * 20, latent_size=4, num_seeds=2)
    swept = train(script, dataclasses.replace(args, sweep=SWEEP))
    alone = train(script, dataclasses.replace(args, seed=2, num_seeds=1, **SECOND))
    return swept, {k: v[0] for k, v in alone.items()}


def run_of(metrics: dict, i: int) -> dict:
    return {k: v[i] for k, v in metrics.items()}


def test_a_configuration_trains_as_its_flags_alone(sweep_runs):
    """Run 3 (second configuration, seed 2) is those flags alone, to the vmapped-seed tolerance;
    the neighbouring configuration with the same seed, and the same configuration with the other
    seed, are not (controls)."""
    swept, alone = sweep_runs
    assert same_run(run_of(swept, 3), alone)
    assert not same_run(run_of(swept, 1), alone)  # control: (1e-3, ...), seed 2
    assert not same_run(run_of(swept, 2), alone)  # control: (3e-3, ...), seed 1
    assert np.isfinite(alone["charts/episodic_return"]).sum() > 5  # episodes ended


def test_the_grid_and_its_runs_in_order():
    args = ppo_nnx.Args(sweep=("learning-rate=1,2", "--ent-coef=0,0.5"), num_seeds=2)
    assert args.configs == [
        {"learning_rate": 1.0, "ent_coef": 0.0},
        {"learning_rate": 1.0, "ent_coef": 0.5},
        {"learning_rate": 2.0, "ent_coef": 0.0},
        {"learning_rate": 2.0, "ent_coef": 0.5},
    ]
    assert [seed for _, seed in args.members] == [1, 2] * 4
    assert [ppo_nnx.config_name(c) for c, _ in args.members[::2]] == [
        "learning-rate=1,ent-coef=0",
        "learning-rate=1,ent-coef=0.5",
        "learning-rate=2,ent-coef=0",
        "learning-rate=2,ent-coef=0.5",
    ]
    assert ppo_nnx.Args().configs == [{}]  # no sweep: one configuration, the flags


@pytest.mark.parametrize(
    "sweep, overrides, message",
    [
        (["num-envs=4,8"], {}, "--sweep num-envs: shapes the program; sweepable: "),
        (["anneal-lr=0,1"], {}, "--sweep anneal-lr: shapes the program"),
        (["foo=1,2"], {}, "--sweep foo: no such flag"),
        (["learning-rate=1e-3,fast"], {}, "--sweep learning-rate=1e-3,fast: give "),
        (["learning-rate"], {}, "--sweep learning-rate: give learning-rate=number"),
        (["gamma=1", "gamma=0.9"], {}, "--sweep names gamma twice"),
        (["gamma=0.9,1.5"], {}, "--gamma must be in [0, 1], got 1.5"),
        (["learning-rate=nan"], {}, "--learning-rate must be >= 0, got nan"),
        (
            ["kl-coef=0.1"],
            {"latent_size": 0},
            "--sweep kl-coef: there is no bottleneck",
        ),
    ],
)
def test_what_cannot_be_swept_is_refused_in_one_line(sweep, overrides, message):
    with pytest.raises(ValueError) as error:
        ppo_nnx.check_args(ppo_nnx.Args(sweep=tuple(sweep), **overrides))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_valid_sweep_passes_the_checks():  # control for the refusals
    sweep = ("gamma=0.9,1", "kl-coef=0.1", "learning-rate=0")
    checked = ppo_nnx.check_args(ppo_nnx.Args(sweep=sweep, latent_size=4))
    assert len(checked.members) == 2


class FakeRun:  # what init_wandb and main use of a W&B run
    def __init__(self, **settings):
        self.settings, self.id, self.summary, self.logged = settings, "id", {}, []

    def define_metric(self, *args, **kwargs):
        pass

    def log(self, row):
        self.logged.append(row)

    def finish(self, exit_code=0):
        self.exit_code = exit_code


def table(output: str) -> list[list[str]]:
    """The rows of the sweep's table printed in `output`."""
    lines = output[output.index("sweep: ") :].splitlines()
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[3:]]


def eval_means(output: str) -> list[float]:
    """Each run's mean evaluated return, from the `eval:` line."""
    line = next(line for line in output.splitlines() if line.startswith("eval: "))
    return [float(r) for r in re.findall(r"(-?[\d.]+)\+-", line)]


def test_a_sweep_logs_ranks_saves_and_reloads(script, capsys, monkeypatch, tmp_path):
    """Through `main`: 2 configurations x 2 seeds. One W&B run each, named and grouped by its
    configuration; a table best first; each configuration's folder evaluates with
    --eval-checkpoint as its runs evaluated in memory."""
    runs = []

    def fake_init(mode=None, **settings):
        runs.append(FakeRun(**settings))
        return runs[-1]

    monkeypatch.setattr(wandb, "init", fake_init)
    monkeypatch.setattr(wandb, "login", lambda **kwargs: True)
    sweep = ("learning-rate=1e-3,3e-2",)
    args = tiny_args(script, num_seeds=2, sweep=sweep, latent_size=4)
    args = dataclasses.replace(args, save_model=True, eval_episodes=2, track=True)
    script.main(args)
    output = capsys.readouterr().out
    names = [run.settings["name"].split("__") for run in runs]
    assert [name[1:4] for name in names] == [
        [args.exp_name, "learning-rate=0.001", "1"],
        [args.exp_name, "learning-rate=0.001", "2"],
        [args.exp_name, "learning-rate=0.03", "1"],
        [args.exp_name, "learning-rate=0.03", "2"],
    ]
    groups = [run.settings["group"] for run in runs]
    assert groups[0] == groups[1] != groups[2] == groups[3]
    assert [run.settings["config"]["learning_rate"] for run in runs] == [1e-3] * 2 + [
        3e-2
    ] * 2
    assert all("eval/episodic_return" in run.logged[-1] for run in runs)

    in_memory = eval_means(output)
    per_config = [np.mean(in_memory[:2]), np.mean(in_memory[2:])]
    rows = table(output)
    assert [row[0] for row in rows] == (
        ["0.001", "0.03"] if per_config[0] >= per_config[1] else ["0.03", "0.001"]
    )
    assert [float(row[2].split(" ± ")[0]) for row in rows] == sorted(
        [round(x, 1) for x in per_config], reverse=True
    )

    (run_dir,) = (tmp_path / "runs").iterdir()
    for config, want in zip(args.configs, (in_memory[:2], in_memory[2:])):
        folder = run_dir / script.config_name(config)
        script.main(script.Args(eval_checkpoint=str(folder), eval_episodes=2))
        assert eval_means(capsys.readouterr().out) == want
