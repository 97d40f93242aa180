"""Who holds which bytes: trainer layouts, engine layouts, name maps (pure Python, no torch).

* ``box``/``types``: the contracts (boxes, ParamSpec, Shard, TrainerLayout, Piece, EngineTensor,
  EngineLayout).
* ``trainer``: FSDP2 / HSDP / ZeRO-3 / Megatron layouts from settings; ``dtensor``: from a live
  module's DTensor placements or DeepSpeed ZeRO-3 partitions (imports torch lazily);
  ``deepspeed``: ZeRO-3's local partitions, checked.
* ``namemap`` + ``vllm_names``: HF transformers-v5 names -> vLLM engine tensors.
* ``engine``: per-rank engine tensors and whole engine layouts (TP, EP, DP, replicas, FP8).
* ``spec``: compact spec strings (``fsdp:256``, ``vllm:tp8,dp4,ep,replicas4``).
"""
