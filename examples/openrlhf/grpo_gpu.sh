#!/usr/bin/env bash
# GRPO with OpenRLHF 0.11.2 on one 8-GPU node: 4 GPUs DeepSpeed ZeRO-3 actor, 4 vLLM engines (TP1),
# run twice: OpenRLHF's own weight sync, then fastsync's. Compare the "broadcast_to_vllm" / step
# times in the two logs (or the timeline in TensorBoard under $OUT/*/tb).
#
#   MODEL=Qwen/Qwen3-8B DATA=openai/gsm8k bash examples/openrlhf/grpo_gpu.sh [openrlhf|fastsync|both]
#
# Needs a CUDA machine with openrlhf==0.11.2, deepspeed, vllm (CUDA build), nixl-cu12 and fastsync
# installed (pip install -e . from this repository, so fastsync_openrlhf is importable).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-8B}
DATA=${DATA:-openai/gsm8k}
OUT=${OUT:-runs/openrlhf-grpo}
WHICH=${1:-both}
HERE=$(cd "$(dirname "$0")" && pwd)

ARGS=(
  --actor.model_name_or_path "$MODEL"
  --actor.num_nodes 1 --actor.num_gpus_per_node 4
  --ref.num_nodes 1 --ref.num_gpus_per_node 4 --train.colocate_actor_ref
  --vllm.num_engines 4 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.8
  --ds.zero_stage 3 --ds.param_dtype bf16 --actor.gradient_checkpointing_enable
  --algo.advantage.estimator group_norm --algo.kl.init_coef 0.001 --algo.kl.use_loss --algo.kl.estimator k3
  --rollout.n_samples_per_prompt 8 --rollout.batch_size 64 --rollout.micro_batch_size 8 --rollout.max_new_tokens 1024
  --train.batch_size 256 --train.micro_batch_size 4 --train.num_episodes 1 --actor.adam.lr 1e-6
  --data.prompt_dataset "$DATA" --data.input_key question --data.label_key answer --data.apply_chat_template
  --data.max_len 2048 --data.max_samples 2048
  --reward.remote_url "$HERE/reward_func.py"
  --vllm.sync_backend nccl
)

if [[ $WHICH == openrlhf || $WHICH == both ]]; then
  python -m openrlhf.cli.train_ppo_ray "${ARGS[@]}" --ckpt.output_dir "$OUT/openrlhf" \
    --logger.tensorboard_dir "$OUT/openrlhf/tb" 2>&1 | tee "$OUT-openrlhf.log"
fi
if [[ $WHICH == fastsync || $WHICH == both ]]; then
  # same arguments; every ZeRO-3 rank writes its own partitions into the engines over NIXL
  python -m fastsync_openrlhf.train_ppo_ray "${ARGS[@]}" --ckpt.output_dir "$OUT/fastsync" \
    --logger.tensorboard_dir "$OUT/fastsync/tb" --fastsync.transport nixl 2>&1 | tee "$OUT-fastsync.log"
  # MoE actors (e.g. MODEL=Qwen/Qwen3-30B-A3B): add --fastsync.moe auto to swap in fastsync's MoE blocks
fi
