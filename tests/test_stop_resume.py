"""Lose nothing: a run in chunks trains what one chunk trains; a signal stops it at a chunk
boundary with its state saved, and `--resume` continues it to the very bits of a run never
stopped; saves that fail, and runs that cannot fit, end in one line.

Every equality check here comes with a control that must fail it.
"""

import dataclasses
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import ppo_nnx
import ppo_nnx_vae_lstm
from conftest import tiny_args


def leaves(state) -> list:
    """A training state as numpy arrays, its PRNG keys as their bits."""
    return [
        np.asarray(
            jax.random.key_data(x)
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            else x
        )
        for x in jax.tree.leaves(state)
    ]


def same(a, b) -> bool:
    """Bitwise: (state, metrics) pairs, every leaf and every metric of every iteration."""
    return (
        all(np.array_equal(x, y) for x, y in zip(leaves(a[0]), leaves(b[0])))
        and a[1].keys() == b[1].keys()
        and all(np.array_equal(a[1][k], b[1][k], equal_nan=True) for k in a[1])
    )


def fresh_envs(state, fresh):
    """The bug a resume could have: the envs restarted, the rest of the state kept."""
    return state._replace(
        runner=state.runner._replace(
            env_state=fresh.runner.env_state, obs=fresh.runner.obs
        )
    )


# ---------------------------------------------------------------------------------------------
# Chunks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "script, seeds",
    [(ppo_nnx, 2), (ppo_nnx_vae_lstm, 1)],
    ids=["ppo_nnx-2-seeds", "ppo_nnx_vae_lstm-1-seed"],
)
def test_chunks_train_what_one_chunk_trains(script, seeds):
    """8 iterations as chunks of 3, 3 and 2 against one chunk of 8: the same state and metrics,
    bitwise. The control restarts the envs at each chunk boundary."""
    args = tiny_args(
        script,
        total_timesteps=4 * 32 * 8,
        latent_size=4,
        num_seeds=seeds,
        env_id="Pendulum-v1",
    )  # normalization on: its statistics carry over too
    one = script.run(dataclasses.replace(args, chunk_iterations=8))[:2]
    program = script.compile_run(dataclasses.replace(args, chunk_iterations=3))
    chunked = script.run(dataclasses.replace(args, chunk_iterations=3), program)[:2]
    assert np.isfinite(one[1]["charts/episodic_return"]).any(-1).all()  # episodes ended
    assert same(chunked, one)
    assert (
        one[1]["global_step"].dtype == np.int64
    )  # counted on the host: no budget wraps it
    init, chunk, _ = program
    state, rows = init(), []
    for n in (3, 3, 2):  # control
        state, metrics = chunk(fresh_envs(state, init()), n)
        rows.append({k: np.asarray(v)[:, :n] for k, v in metrics.items()})
    restarted = (state, {k: np.concatenate([r[k] for r in rows], 1) for k in rows[0]})
    assert not same(
        restarted, (one[0], {k: v for k, v in one[1].items() if k != "global_step"})
    )


# ---------------------------------------------------------------------------------------------
# Stop with a real signal, then resume
# ---------------------------------------------------------------------------------------------
def flags(args) -> list:
    return [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if v != getattr(type(args), k)
    ]


def stop(script, cli: list, cwd, sig, env=None):
    """Start the script, send `sig` once its first progress line is out: (returncode, stderr)."""
    process = subprocess.Popen(
        [sys.executable, script.__file__, *cli],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not process.stdout.readline().startswith("global_step="):
        assert process.poll() is None, process.stderr.read()
    process.send_signal(sig)
    _, err = process.communicate(timeout=300)
    return process.returncode, err


@pytest.mark.parametrize(
    "script, sig",
    [(ppo_nnx, signal.SIGINT), (ppo_nnx_vae_lstm, signal.SIGTERM)],
    ids=["ppo_nnx-SIGINT", "ppo_nnx_vae_lstm-SIGTERM"],
)
def test_a_stopped_run_resumes_to_the_same_bits(script, sig, tmp_path, monkeypatch):
    """`main` in a process of its own, stopped by a real signal at a chunk boundary, then
    `--resume`d with --save-model: its final state and every iteration's metrics equal those of
    the run never stopped. The control resumes the same checkpoint with fresh envs."""
    args = tiny_args(
        script, total_timesteps=4 * 32 * 150, latent_size=4, chunk_iterations=1
    )
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
    }
    code, err = stop(script, flags(args) + ["--track"], tmp_path, sig, env)
    lines = err.strip().splitlines()
    assert code == 128 + sig and len(lines) == 1, err
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert lines[0].startswith(f"stopped by {sig.name} at iteration "), lines
    assert lines[0].endswith(
        f"resume with: python {script.__name__}.py --resume runs/{run_dir.name}"
    ), lines
    done = int(lines[0].split("at iteration ")[1].split()[0])
    assert 0 < done < args.num_iterations
    stopped_copy = shutil.copytree(run_dir, tmp_path / "stopped")  # for the control

    resumed = subprocess.run(
        [
            sys.executable,
            script.__file__,
            "--resume",
            f"runs/{run_dir.name}",
            "--save-model",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"global_step={args.total_timesteps:>9d} (100%" in resumed.stdout
    wandb_runs = sorted(
        p.name.split("-")[-1] for p in (tmp_path / "wandb").glob("offline-run-*")
    )
    assert (
        len(wandb_runs) == 2 and wandb_runs[0] == wandb_runs[1]
    )  # one W&B run, resumed

    program = script.compile_run(args)
    never_stopped = script.run(args, program)[:2]
    like = program[0]()
    state, history, _ = script.restore_state(str(run_dir), args.num_iterations, like)
    metrics = {k: v for k, v in never_stopped[1].items() if k != "global_step"}
    assert same((state, history), (never_stopped[0], metrics))
    state, history, _ = script.restore_state(str(stopped_copy), done, like)  # control
    restarted = script.run(args, program, (fresh_envs(state, like), history, done))[:2]
    assert not same(restarted, never_stopped)


def test_a_second_signal_stops_at_once_and_keeps_the_last_save(tmp_path):
    """Chunks of about 10 s, a save after each: a second Ctrl-C kills the process in the chunk
    under way (the first only asks it to stop at the chunk's end), and the state saved before
    still resumes. The chunks are long so that both signals land inside the second one, on a
    loaded machine too; with 1 s chunks the run could stop and exit before the second arrived."""
    chunk = 20_000
    args = tiny_args(
        ppo_nnx,
        total_timesteps=4 * 32 * 3 * chunk,
        chunk_iterations=chunk,
        save_every=chunk,
    )
    process = subprocess.Popen(
        [sys.executable, ppo_nnx.__file__, *flags(args)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not process.stdout.readline().startswith("saved the training state: runs/"):
        assert process.poll() is None, process.stderr.read()
    time.sleep(
        1.0
    )  # into the second chunk: a signal before it would stop the run there
    process.send_signal(signal.SIGINT)
    time.sleep(0.5)  # the first one seen: its handler hands the next one to the system
    process.send_signal(signal.SIGINT)
    # killed by the signal (a stop at the chunk's end exits 130 and saves again)
    assert process.wait(timeout=300) == -signal.SIGINT, process.stderr.read()
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert [p.name for p in (run_dir / "state").iterdir()] == [str(chunk)]
    resumed, meta = ppo_nnx.load_stopped(ppo_nnx.Args(resume=str(run_dir)))
    assert meta["done"] == chunk and resumed.total_timesteps == args.total_timesteps


# ---------------------------------------------------------------------------------------------
# Refusals in one line
# ---------------------------------------------------------------------------------------------
def refused(script, capsys, args) -> str:
    """`main(args)` must exit 2 with one line on stderr: that line."""
    with pytest.raises(SystemExit) as exit_:
        script.main(args)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A tiny ppo_nnx.py run saved with --save-model, and its folder."""
    cwd = tmp_path_factory.mktemp("finished")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        ppo_nnx.main(tiny_args(ppo_nnx, save_model=True))
    (run_dir,) = (cwd / "runs").iterdir()
    return run_dir


def test_resume_refuses_what_it_cannot_continue(finished, tmp_path, capsys):
    assert "the run has finished; --eval-checkpoint" in refused(
        ppo_nnx, capsys, ppo_nnx.Args(resume=str(finished))
    )
    assert "--learning-rate cannot change the run saved at" in refused(
        ppo_nnx, capsys, ppo_nnx.Args(resume=str(finished), learning_rate=1e-3)
    )
    assert f"--resume {tmp_path} holds no training state" in refused(
        ppo_nnx, capsys, ppo_nnx.Args(resume=str(tmp_path))
    )
    assert "ppo_nnx.py saved it" in refused(
        ppo_nnx_vae_lstm, capsys, ppo_nnx_vae_lstm.Args(resume=str(finished))
    )
    unfinished = shutil.copytree(
        finished, tmp_path / "unfinished"
    )  # control: step 7 named 3
    (unfinished / "state" / "7").rename(unfinished / "state" / "3")
    assert ppo_nnx.load_stopped(ppo_nnx.Args(resume=str(unfinished)))[1]["done"] == 3


def test_eval_checkpoint_says_what_it_expected(finished, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no seed_* model: give a folder runs/" in refused(
        ppo_nnx, capsys, ppo_nnx.Args(eval_checkpoint=str(empty))
    )
    assert f"it is one seed's; give its run folder, {finished}" in refused(
        ppo_nnx, capsys, ppo_nnx.Args(eval_checkpoint=str(finished / "seed_1"))
    )
    stopped = shutil.copytree(
        finished, tmp_path / "stopped", ignore=shutil.ignore_patterns("seed_*")
    )
    assert f"it is a stopped run; --resume {stopped} finishes it" in refused(
        ppo_nnx, capsys, ppo_nnx.Args(eval_checkpoint=str(stopped))
    )


def test_unwritable_run_folder_is_refused_before_compiling(
    tmp_path, monkeypatch, capsys
):
    """As root, permissions do not stop a write: `runs` made a file stands for a read-only disk."""
    (tmp_path / "runs").write_text("not a folder")
    monkeypatch.setattr(ppo_nnx, "compile_run", lambda args: sys.exit("compiled"))
    err = refused(ppo_nnx, capsys, tiny_args(ppo_nnx))
    assert (
        err.startswith("error: cannot write the run folder in ") and "runs/" in err
    ), err
    (tmp_path / "runs").unlink()  # control
    with pytest.raises(SystemExit, match="compiled"):
        ppo_nnx.main(tiny_args(ppo_nnx))


def test_a_run_too_big_for_memory_is_refused_naming_flags(monkeypatch, capsys):
    """XLA's count of the compiled chunk's memory against what the device has free: a device of
    1 kB refuses the tiny run, in one line from `main`; 1 GB (the control) takes it."""
    monkeypatch.setattr(ppo_nnx, "free_memory", lambda device: 1e9)
    args = ppo_nnx.check_args(tiny_args(ppo_nnx))
    chunk = ppo_nnx.compile_run(args)[1].func  # the compiled program
    monkeypatch.setattr(ppo_nnx, "free_memory", lambda device: 1e3)
    with pytest.raises(ValueError) as error:
        ppo_nnx.check_memory(args, chunk)
    assert "GiB of memory" in str(error.value)
    assert "--num-envs 4, --num-steps 32 or --num-seeds 1" in str(error.value)
    monkeypatch.setattr(
        ppo_nnx, "compile_run", lambda args: ppo_nnx.check_memory(args, chunk)
    )
    assert str(error.value) in refused(
        ppo_nnx, capsys, tiny_args(ppo_nnx)
    )  # through main


# ---------------------------------------------------------------------------------------------
# A save that fails after training
# ---------------------------------------------------------------------------------------------
def test_a_failed_save_falls_back_then_says_what_was_lost(
    tmp_path, monkeypatch, capsys
):
    """A full disk under runs/: the model goes to the temporary folder; a full disk there too:
    one line naming both, exit 1, no traceback, no half-written folder left."""
    monkeypatch.setattr(ppo_nnx.tempfile, "tempdir", str(tmp_path / "tmp"))
    save_model, full = ppo_nnx.save_model, ["runs"]

    def filling(folder, *args):
        if any(part in str(folder) for part in full):
            (Path(folder) / "seed_1.orbax-checkpoint-tmp-1").mkdir(parents=True)
            raise OSError(errno.ENOSPC, "No space left on device")
        save_model(folder, *args)

    monkeypatch.setattr(ppo_nnx, "save_model", filling)
    ppo_nnx.main(tiny_args(ppo_nnx, save_model=True))
    out = capsys.readouterr().out
    (fallback,) = (tmp_path / "tmp").iterdir()
    assert f"saved the model: {fallback}" in out and (fallback / "seed_1").is_dir()
    full.append("tmp")
    with pytest.raises(SystemExit) as exit_:
        ppo_nnx.main(tiny_args(ppo_nnx, save_model=True))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 1 and len(err) == 1, err
    assert err[0].startswith("error: could not save the model, lost: runs/") and (
        "No space left on device" in err[0]
    ), err
    assert not list(tmp_path.rglob("*.orbax-checkpoint-tmp*"))
