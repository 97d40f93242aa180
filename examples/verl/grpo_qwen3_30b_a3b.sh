#!/usr/bin/env bash
# GRPO on Qwen3-30B-A3B with verl 0.9.1, disaggregated (separate_async: trainer and rollout on
# their own GPUs), with and without fastsync. NOT RUN: written on a CPU-only machine; keys follow
# verl 0.9.1's ppo_trainer.yaml / rollout.yaml. Needs 2 nodes x 8 GPUs (1 trainer, 1 rollout).
#
#   bash examples/verl/grpo_qwen3_30b_a3b.sh fastsync   # fastsync backend, FSDP2 shards, no full_tensor()
#   bash examples/verl/grpo_qwen3_30b_a3b.sh nixl       # verl's own nixl backend, for comparison
#
# Compare the per-sync timing metrics verl logs (timing_s/update_weights) and fastsync's
# fastsync/trainer*/send_s between the two runs.
set -euo pipefail
BACKEND=${1:-fastsync}
MODEL=${MODEL:-Qwen/Qwen3-30B-A3B}
DATA=${DATA:-$HOME/data/gsm8k}

EXTRA=()
if [[ "$BACKEND" == fastsync ]]; then
  EXTRA+=(
    actor_rollout_ref.rollout.checkpoint_engine.backend=fastsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=fastsync_verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fastsync.trainer_shards=auto
    # in place into verl's vLLM server (fastsync's worker extension composed with verl's); the session
    # falls back to the full-tensor path, logged, where it cannot serve (see adapters/verl/README.md):
    +actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=fastsync_verl.extension.FastSyncVerlWorkerExtension
    # MoE: verl un-fuses packed experts on export, so the shard path falls back to full tensors
    # (logged) for this model until fastsync maps packed experts itself; the MoE swap still applies:
    actor_rollout_ref.model.external_lib=fastsync_verl.moe
  )
else
  EXTRA+=(actor_rollout_ref.rollout.checkpoint_engine.backend="$BACKEND")
fi

python -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  data.train_batch_size=256 data.max_prompt_length=1024 data.max_response_length=2048 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.hybrid_engine=false \
  trainer.use_v1=true trainer.v1.trainer_mode=separate_async \
  actor_rollout_ref.actor.strategy=fsdp2 \
  actor_rollout_ref.actor.ppo_mini_batch_size=64 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
  actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.mode=async \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
  actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=8 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.8 \
  trainer.nnodes=1 trainer.n_gpus_per_node=8 \
  trainer.total_epochs=1 trainer.logger='["console"]' \
  trainer.project_name=fastsync-verl trainer.experiment_name="qwen3-30b-a3b-grpo-$BACKEND" \
  "${EXTRA[@]}"
