"""--save-model, --eval-episodes and --eval-checkpoint: a saved run evaluates exactly as the run in
memory did, and a bad checkpoint or flag is refused in one line, with nothing written."""

import shutil
import sys
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import ppo_nnx
import ppo_nnx_vae_lstm
from conftest import TINY_FLAGS, run_cli, tiny_args

SCRIPTS = {"ppo_nnx": ppo_nnx, "ppo_nnx_vae_lstm": ppo_nnx_vae_lstm}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per script: a 2-seed Pendulum run (normalized) trained, saved and evaluated by `main`, then
    evaluated again from its checkpoint: (run directory, [in memory, from checkpoint] returns)."""
    runs = {}
    for name, script in SCRIPTS.items():
        cwd, returns, evaluate = tmp_path_factory.mktemp(name), [], script.evaluate

        def recorded(*args):  # the script's evaluate, its results kept
            returns.append(evaluate(*args))
            return returns[-1]

        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(cwd)
            patch.setattr(script, "evaluate", recorded)
            script.main(
                tiny_args(
                    script,
                    env_id="Pendulum-v1",
                    num_seeds=2,
                    save_model=True,
                    eval_episodes=3,
                )
            )
            (run_dir,) = (cwd / "runs").iterdir()
            script.main(script.Args(eval_checkpoint=str(run_dir), eval_episodes=3))
        runs[name] = run_dir, returns
    return runs


def snapshot(folder: Path) -> dict:
    return {
        path: path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()
    }


@pytest.fixture(params=list(SCRIPTS))
def name(request):
    return request.param


def test_saved_run_evaluates_exactly_as_in_memory(saved, name):
    run_dir, (in_memory, loaded) = saved[name]
    assert sorted(p.name for p in run_dir.iterdir()) == ["seed_1", "seed_2", "state"]
    assert in_memory.shape == (2, 3) and np.isfinite(in_memory).all()
    np.testing.assert_array_equal(loaded, in_memory)
    assert not np.array_equal(in_memory[0], in_memory[1])  # control: seeds differ


def test_wrong_statistics_change_the_evaluation(saved, name):
    """Control: the loaded weights evaluate otherwise with statistics that never saw an
    observation, as weights saved without their statistics would."""
    script, (run_dir, (in_memory, _)) = SCRIPTS[name], saved[name]
    args, params, norm = script.load_run(
        script.Args(eval_checkpoint=str(run_dir), eval_episodes=3)
    )
    assert (args.env_id, args.num_seeds, args.norm_obs, args.save_model) == (
        "Pendulum-v1",
        2,
        True,
        False,
    )
    fresh = norm._replace(
        obs=dict(
            norm.obs,
            mean=jnp.zeros_like(norm.obs["mean"]),
            var=jnp.ones_like(norm.obs["var"]),
        )
    )
    assert not np.allclose(script.evaluate(args, params, fresh), in_memory)


def test_evaluation_flags_are_this_commands(saved, name, tmp_path):
    """With --eval-checkpoint the evaluation flags are the command's, not the saved run's (10
    episodes unless given), and stray files beside the seeds' entries do not matter."""
    script, run_dir = SCRIPTS[name], saved[name][0]
    copy = shutil.copytree(run_dir, tmp_path / "run")
    (copy / ".DS_Store").write_bytes(b"")
    args = script.load_run(
        script.Args(eval_checkpoint=str(copy), eval_deterministic=True)
    )[0]
    assert (args.eval_episodes, args.eval_deterministic, args.track) == (0, True, False)
    assert (
        script.load_run(script.Args(eval_checkpoint=str(copy)))[0].eval_deterministic
        is False
    )


def refused(script, capsys, **flags) -> str:
    """`main` with these flags must exit 2 with one line on stderr: that line."""
    with pytest.raises(SystemExit) as exit_:
        script.main(script.Args(**flags))
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_bad_checkpoints_are_refused_in_one_line(saved, name, tmp_path, capsys):
    script, other = SCRIPTS[name], [n for n in SCRIPTS if n != name][0]
    run_dir = saved[name][0]
    corrupt = {}  # a copy with one item of one seed made garbage, for each item
    for seed, item in [(2, "params"), (1, "norm"), (1, "args")]:
        corrupt[item] = shutil.copytree(run_dir, tmp_path / f"corrupt {item}")
        for path in (corrupt[item] / f"seed_{seed}" / item).rglob("*"):
            if path.is_file():
                path.write_bytes(b"not a checkpoint")
    before = {d: snapshot(d) for d in (run_dir, saved[other][0], *corrupt.values())}
    missing = refused(script, capsys, eval_checkpoint=str(tmp_path / "missing"))
    assert missing.startswith(f"error: --eval-checkpoint {tmp_path / 'missing'}")
    for path in corrupt.values():
        assert refused(script, capsys, eval_checkpoint=str(path)).startswith(
            f"error: --eval-checkpoint {path} is not a run saved by {name}.py"
        )
    assert f"{other}.py saved it" in refused(
        script, capsys, eval_checkpoint=str(saved[other][0])
    )
    assert "--hidden-size" in refused(
        script, capsys, eval_checkpoint=str(run_dir), hidden_size=8
    )
    assert "--seed" in refused(script, capsys, eval_checkpoint=str(run_dir), seed=5)
    assert {d: snapshot(d) for d in before} == before  # nothing written
    # control: the unbroken run loads
    assert script.load_run(script.Args(eval_checkpoint=str(run_dir)))[0].num_seeds == 2


def test_a_taken_run_name_moves_to_the_next_second(script, tmp_path, monkeypatch):
    """Two runs started in the same second: the second reserves the next stamp, before compiling,
    and never touches the first one's folder."""
    monkeypatch.setattr(script, "time", types.SimpleNamespace(time=lambda: 1234.0))
    monkeypatch.setattr(script, "compile_run", lambda args: sys.exit("compiling"))
    args = tiny_args(script, save_model=True)
    name = f"CartPole-v1__{args.exp_name}__1"
    with pytest.raises(
        SystemExit, match="compiling"
    ):  # control: a free name is taken as is
        script.main(args)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [f"{name}__1234"]
    (tmp_path / "runs" / f"{name}__1234" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="compiling"):
        script.main(args)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
        f"{name}__1234",
        f"{name}__1235",
    ]
    assert snapshot(tmp_path / "runs") == {
        tmp_path / "runs" / f"{name}__1234" / "notes.txt": b"mine"
    }


def test_cli_saves_then_evaluates_the_same_return(tmp_path):
    """A user's commands, tiny and sampled: train, save, --eval-checkpoint; the same eval line."""
    first = run_cli(
        ppo_nnx, *TINY_FLAGS, "--save-model", "--eval-episodes", "10", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    again = run_cli(ppo_nnx, "--eval-checkpoint", str(run_dir), cwd=tmp_path)
    assert again.returncode == 0, again.stderr

    def eval_lines(out):
        return [line for line in out.splitlines() if line.startswith("eval:")]

    assert len(eval_lines(first.stdout)) == 1
    assert eval_lines(again.stdout) == eval_lines(first.stdout)
    assert "10 episodes, deterministic=False" in eval_lines(first.stdout)[0]
