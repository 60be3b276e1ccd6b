"""The command line of both scripts (fixture `script`): help, a tiny run, W&B offline, bad input."""

import pytest

from conftest import TINY_FLAGS, run_cli


def test_help(script):
    result = run_cli(script, "--help")
    assert result.returncode == 0
    for flag in (
        "--num-minibatches",
        "--latent-size",
        "--mask-velocity",
        "--num-seeds",
        "--norm-obs",
        "--save-model",
        "--eval-episodes",
        "--eval-checkpoint",
        "--shard-envs",
    ):
        assert flag in result.stdout
    assert (
        "the number of parallel game environments" in result.stdout
    )  # help from the comments


def check_progress_and_summary(result, num_seeds: int, seeds: str):
    """Progress lines come live from the compiled loop, one per report with every seed's return."""
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    progress = [line for line in lines if line.startswith("global_step=")]
    summary = [line for line in lines if line.startswith("summary:")]
    assert progress and progress[-1].startswith(
        "global_step=     1024 (100%, 0 s left)"
    )
    returns = (
        progress[-1].split("episodic_return=")[1].split()[:-1]
    )  # the last is SPS=...
    assert len(returns) == int(num_seeds), progress[-1]
    assert len(summary) == 1 and seeds in summary[0] and "SPS=" in summary[0]


def test_tiny_run_prints_progress_and_summary(script):
    check_progress_and_summary(run_cli(script, *TINY_FLAGS), 1, "seeds=[1]")


def test_track_writes_offline_wandb_runs(script, tmp_path):
    """Two seeds: the console shows both, and each gets its own W&B run."""
    result = run_cli(
        script,
        *TINY_FLAGS,
        "--num-seeds",
        "2",
        "--track",
        "--eval-episodes",
        "2",
        cwd=tmp_path,
        env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)},
    )
    check_progress_and_summary(result, 2, "seeds=[1, 2]")
    run_files = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 2  # one run per seed
    iterations = 1024 // (4 * 32)
    for run_file in run_files:
        data = run_file.read_bytes()
        assert (
            data.count(b"charts/episodic_return") >= iterations
        )  # logged every iteration
        assert data.count(b"losses/approx_kl") >= iterations
        assert b"eval/episodic_return_std" in data  # the evaluation after training
    names = b"".join(f.read_bytes() for f in run_files)
    for seed in (1, 2):
        assert f"CartPole-v1__{script.__name__}__{seed}__".encode() in names


def test_unknown_env_exits_2_via_cli(script):
    result = run_cli(script, "--env-id", "NoSuchEnv-v0")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--env-id" in lines[0] and "CartPole-v1" in lines[0]


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(num_steps=100, num_minibatches=3), "--num-minibatches"),
        (dict(total_timesteps=100), "--total-timesteps"),
        (dict(num_envs=0), "--num-envs"),
        (dict(num_steps=-5), "--num-steps"),
        (dict(update_epochs=0), "--update-epochs"),
        (dict(num_seeds=0), "--num-seeds"),
        (dict(gamma=1.5), "--gamma"),
        (dict(learning_rate=float("nan")), "--learning-rate"),
        (dict(latent_size=-1), "--latent-size"),
        (dict(activation="gelu"), "--activation"),
        (dict(encoder="conv"), "--encoder conv needs image observations"),  # CartPole
        (dict(env_id="Acrobot-v1", mask_velocity=True), "--mask-velocity"),
        (dict(seed=3_000_000_000), "--seed"),
        (dict(seed=2**31 - 2, num_seeds=4), "--seed"),
        (dict(total_timesteps=10**13), "--total-timesteps"),
        (dict(num_envs=4, num_steps=2, num_minibatches=8), "--num-minibatches"),
        (dict(exp_name="../../x"), "--exp-name"),
        (dict(save_every=-1), "--save-every"),
        (dict(chunk_iterations=-1), "--chunk-iterations"),
        (dict(resume="runs/a", eval_checkpoint="runs/a"), "--resume"),
    ],
)
def test_bad_input_exits_2_with_one_line(script, capsys, overrides, flag):
    with pytest.raises(SystemExit) as exit_info:
        script.main(script.Args(**overrides))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and flag in err[0], err


def test_recurrent_minibatches_must_divide_the_envs(capsys):
    """Minibatches hold whole sequences, so they split the envs, not the batch."""
    import ppo_nnx_vae_lstm

    with pytest.raises(SystemExit) as exit_info:
        ppo_nnx_vae_lstm.main(
            ppo_nnx_vae_lstm.Args(num_envs=6, num_steps=32, num_minibatches=4)
        )
    assert exit_info.value.code == 2  # 4 divides the batch 6 * 32, not the 6 envs
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "--num-minibatches 4" in err[0] and "--num-envs 6" in err[0]
    ), err


def test_limits_take_their_last_allowed_value(script):
    """Controls for the refusals above: each limit's last allowed value passes check_args."""
    for overrides in [
        dict(seed=2**31 - 4, num_seeds=4),
        dict(seed=-(2**31)),
        dict(num_envs=8, num_steps=1, num_minibatches=4),  # 2 samples each
        dict(num_steps=1, num_envs=1, num_minibatches=1, norm_adv=False),
        dict(total_timesteps=(2**31 - 1) // 16 * 512, num_steps=128),
        dict(exp_name="sweep.lr-3e-4"),
    ]:
        script.check_args(script.Args(**overrides))
