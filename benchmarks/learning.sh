#!/usr/bin/env bash
# Learning curves: each run trains 8 seeds in one program, evaluates each trained policy on 100
# episodes (deterministic) and writes its own result file; report.py then makes the tables and
# plots from all of them. About 2 h on a 2-core CPU, 40 min without the two MinAtar runs.
#   bash benchmarks/learning.sh                       # from the repository root
#   PYTHON=.venv/bin/python bash benchmarks/learning.sh
# A subset: paste the lines up to the first `record`, then the runs you want, then the report.
set -euo pipefail
record() { timeout 3h "${PYTHON:-python}" benchmarks/record.py "$@" --eval-episodes 100 \
    --eval-deterministic; }  # a hung run stops at the timeout
OUT=benchmarks/results/learning
# After RL Zoo's PPO settings for Pendulum (4 envs x 1024 steps, 10 epochs, gamma 0.9).
# Continuous actions: observations and rewards normalized by default (--norm-obs, --norm-reward).
PENDULUM=(--env-id Pendulum-v1 --total-timesteps 1000000 --num-envs 4 --num-steps 1024
          --update-epochs 10 --learning-rate 1e-3 --gamma 0.9 --ent-coef 0)
# PureJaxRL's MinAtar settings (64 envs x 128 steps, 8 minibatches, lr 5e-4), 10M steps.
MINATAR=(--total-timesteps 10000000 --num-envs 64 --num-steps 128 --num-minibatches 8
         --learning-rate 5e-4)

# Tuned per env (budget, envs, epochs, learning rate, gamma), never the algorithm per env.
record --name "ppo_nnx CartPole-v1" $OUT/ppo_nnx-CartPole-v1.json \
    ppo_nnx --env-id CartPole-v1 --num-seeds 8  # CleanRL's ppo.py defaults, 500k steps
record --name "ppo_nnx Acrobot-v1" $OUT/ppo_nnx-Acrobot-v1.json \
    ppo_nnx --env-id Acrobot-v1 --total-timesteps 1000000 --num-seeds 8
# The same two normalized: the measurement behind the discrete default (off).
record --name "ppo_nnx CartPole-v1 normalized" $OUT/ppo_nnx-CartPole-v1-normalized.json \
    ppo_nnx --env-id CartPole-v1 --num-seeds 8 --norm-obs True --norm-reward True
record --name "ppo_nnx Acrobot-v1 normalized" $OUT/ppo_nnx-Acrobot-v1-normalized.json \
    ppo_nnx --env-id Acrobot-v1 --total-timesteps 1000000 --num-seeds 8 \
    --norm-obs True --norm-reward True
record --name "ppo_nnx Pendulum-v1" $OUT/ppo_nnx-Pendulum-v1.json \
    ppo_nnx "${PENDULUM[@]}" --num-seeds 8
record --name "ppo_nnx MountainCarContinuous-v0" $OUT/ppo_nnx-MountainCarContinuous-v0.json \
    ppo_nnx --env-id MountainCarContinuous-v0 --total-timesteps 1000000 --num-seeds 8
# The same two without normalization: the measurement behind the continuous default.
record --name "ppo_nnx Pendulum-v1 unnormalized" $OUT/ppo_nnx-Pendulum-v1-unnormalized.json \
    ppo_nnx "${PENDULUM[@]}" --num-seeds 8 --norm-obs False --norm-reward False
record --name "ppo_nnx MountainCarContinuous-v0 unnormalized" \
    $OUT/ppo_nnx-MountainCarContinuous-v0-unnormalized.json ppo_nnx \
    --env-id MountainCarContinuous-v0 --total-timesteps 1000000 --num-seeds 8 \
    --norm-obs False --norm-reward False
record --name "ppo_nnx Breakout-MinAtar" $OUT/ppo_nnx-Breakout-MinAtar.json \
    ppo_nnx --env-id Breakout-MinAtar "${MINATAR[@]}" --num-seeds 8
record --name "ppo_nnx SpaceInvaders-MinAtar" $OUT/ppo_nnx-SpaceInvaders-MinAtar.json \
    ppo_nnx --env-id SpaceInvaders-MinAtar "${MINATAR[@]}" --num-seeds 8
# Masked: velocities hidden, which a feed-forward policy cannot make up for.
record --name "ppo_nnx CartPole-v1 masked" $OUT/ppo_nnx-CartPole-v1-masked.json \
    ppo_nnx --env-id CartPole-v1 --mask-velocity --total-timesteps 1000000 --num-seeds 8
record --name "ppo_nnx Pendulum-v1 masked" $OUT/ppo_nnx-Pendulum-v1-masked.json \
    ppo_nnx "${PENDULUM[@]}" --mask-velocity --num-seeds 8
record --name "ppo_nnx_vae_lstm CartPole-v1" $OUT/ppo_nnx_vae_lstm-CartPole-v1.json \
    ppo_nnx_vae_lstm --env-id CartPole-v1 --num-seeds 8  # the recurrent defaults, 1M steps
record --name "ppo_nnx_vae_lstm CartPole-v1 masked" \
    $OUT/ppo_nnx_vae_lstm-CartPole-v1-masked.json \
    ppo_nnx_vae_lstm --env-id CartPole-v1 --mask-velocity --num-seeds 8
record --name "ppo_nnx_vae_lstm Pendulum-v1 masked" \
    $OUT/ppo_nnx_vae_lstm-Pendulum-v1-masked.json \
    ppo_nnx_vae_lstm "${PENDULUM[@]}" --mask-velocity --num-minibatches 4 --num-seeds 8

"${PYTHON:-python}" benchmarks/report.py
