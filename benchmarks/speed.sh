#!/usr/bin/env bash
# Speed of the compiled train functions beside rejax's PPO: each configuration runs in its own
# process (compile once, 3 timed calls) and writes its own result file; report.py then makes the
# table from all of them. About 22 min on a 2-core CPU.
#   bash benchmarks/speed.sh                          # from the repository root
#   PYTHON=.venv/bin/python bash benchmarks/speed.sh
# A subset: paste the lines up to the loop, then the lines you want with k set, then the report.
set -euo pipefail
record() { timeout 10m "${PYTHON:-python}" benchmarks/record.py --repeats 3 "$@"; }
OUT=benchmarks/results/speed
# CleanRL's CartPole settings (with --num-envs 4 and 500k steps), shared by ppo_nnx.py's defaults
CLEANRL=(--num-steps 128 --update-epochs 4 --num-minibatches 4)
# ppo_nnx_vae_lstm.py's defaults that ppo_nnx.py has too (and its bottleneck: --latent-size 16)
RECURRENT=(--num-envs 32 --num-steps 32 --update-epochs 4 --num-minibatches 2)

# Rounds alternate the configurations, so a slow minute on a noisy machine hits all of them alike.
for k in 1 2 3; do
    record --name "ppo_nnx" $OUT/ppo_nnx/round$k.json \
        ppo_nnx --num-envs 4 "${CLEANRL[@]}" --total-timesteps 500000
    record --name "rejax" $OUT/rejax/round$k.json \
        rejax --num-envs 4 "${CLEANRL[@]}" --total-timesteps 500000
    record --name "ppo_nnx 64 envs" $OUT/ppo_nnx-64-envs/round$k.json \
        ppo_nnx --num-envs 64 "${CLEANRL[@]}" --total-timesteps 500000
    record --name "rejax 64 envs" $OUT/rejax-64-envs/round$k.json \
        rejax --num-envs 64 "${CLEANRL[@]}" --total-timesteps 500000
    record --name "ppo_nnx 8 seeds" $OUT/ppo_nnx-8-seeds/round$k.json \
        ppo_nnx --num-envs 4 "${CLEANRL[@]}" --total-timesteps 200000 --num-seeds 8
    XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=2" \
        record --name "ppo_nnx 8 seeds, 2 CPU devices" $OUT/ppo_nnx-8-seeds-2-devices/round$k.json \
        ppo_nnx --num-envs 4 "${CLEANRL[@]}" --total-timesteps 200000 --num-seeds 8
    record --name "ppo_nnx 32 seeds" $OUT/ppo_nnx-32-seeds/round$k.json \
        ppo_nnx --num-envs 4 "${CLEANRL[@]}" --total-timesteps 100000 --num-seeds 32
    record --name "ppo_nnx_vae_lstm defaults" $OUT/ppo_nnx_vae_lstm-defaults/round$k.json \
        ppo_nnx_vae_lstm --total-timesteps 500000
    record --name "ppo_nnx_vae_lstm at ppo_nnx settings" \
        $OUT/ppo_nnx_vae_lstm-at-ppo_nnx-settings/round$k.json \
        ppo_nnx_vae_lstm --num-envs 4 "${CLEANRL[@]}" --total-timesteps 500000
    record --name "ppo_nnx at ppo_nnx_vae_lstm settings" \
        $OUT/ppo_nnx-at-ppo_nnx_vae_lstm-settings/round$k.json \
        ppo_nnx "${RECURRENT[@]}" --latent-size 16 --total-timesteps 500000
    record --name "ppo_nnx at ppo_nnx_vae_lstm settings, no bottleneck" \
        $OUT/ppo_nnx-at-ppo_nnx_vae_lstm-settings-no-bottleneck/round$k.json \
        ppo_nnx "${RECURRENT[@]}" --total-timesteps 500000
    record --name "random actions (floor)" $OUT/floor/round$k.json \
        floor --num-envs 4 --total-timesteps 500000
done

"${PYTHON:-python}" benchmarks/report.py
