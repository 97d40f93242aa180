"""The OpenRLHF matrix's trainer-rank calls (not a test module): each is defined inside a function
so Ray ships it by value through ``__ray_call__`` (a test module is not importable by name in
Ray's workers, and nor is this one), and runs on the DeepSpeed ZeRO-3 ranks of
``fastsync_rigs.openrlhf_cpu``."""

from __future__ import annotations


def calls():
    """The adapter's lazy build with a version base, the last sync's kind, trainer rank 0's plan,
    and the collective ZeRO-3 gather of the full weights."""

    def build(self, base: int):  # the adapter's own lazy build, done first so versions continue
        t = self.trainer
        t._fastsync_sync = t._fastsync_build()
        t._fastsync_sync.setup()
        t._fastsync_sync.version = base
        return True

    def last_kind(self):
        return self.trainer._fastsync_sync.ws.last_kind

    def planned(self):  # trainer rank 0's plan: replicas planned once, relays or not
        plan = self.trainer._fastsync_sync.ws.plan
        return plan.fanout.replicas if plan.fanout is not None else 1, plan.has_relays

    def full_weights(self):  # collective: ZeRO-3 gathers on every rank
        import deepspeed

        params = list(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.data.clone() for n, p in params} if self.rank == 0 else None

    return build, last_kind, full_weights, planned


def actor_build():
    """The trainer-rank call that builds the policy as OpenRLHF's ``PolicyModelActor`` does, shipped
    by value through ``__ray_call__`` (see :func:`calls`)."""

    def build_actor(self, model_dir: str, opts: dict, lora: dict | None = None) -> dict:
        import deepspeed
        import torch
        import openrlhf.utils.utils as openrlhf_utils
        from openrlhf.trainer.ray import ppo_actor

        from fastsync_openrlhf.trainer import install_trainer
        from fastsync_rigs.openrlhf_cpu import openrlhf_args

        if self.trainer is not None and getattr(self.trainer, "_fastsync_sync", None) is not None:
            self.trainer._fastsync_sync.close()  # the previous cell's session
        self.trainer = self.engine = self.opt = None
        install_trainer(openrlhf_args(fastsync=opts))  # FastSyncPolicyModel.init_model_from_pretrained
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3, "stage3_allgather_sequential": True},  # see the rig
                  "zero_allow_untested_optimizer": True}
        # STAND-IN: OpenRLHF's Actor takes --ds.param_dtype bf16/fp16 only; the matrix compares fp32
        # bytes and greedy tokens against an fp32 engine, as the dense cells do
        to_dtype = openrlhf_utils.convert_to_torch_dtype
        openrlhf_utils.convert_to_torch_dtype = lambda _dtype: torch.float32
        try:  # ppo_actor.Actor: OpenRLHF's, or with --fastsync.moe the adapter's swap after it
            actor = ppo_actor.Actor(model_dir, attn_implementation="sdpa", param_dtype="bf16", ds_config=config,
                                    **(lora or {}))
        finally:
            openrlhf_utils.convert_to_torch_dtype = to_dtype
        partitioned = all(hasattr(p, "ds_id") for p in actor.model.parameters())
        trained = [p for p in actor.model.parameters() if p.requires_grad]  # with LoRA: the adapters only
        self.engine, self.opt, _, _ = deepspeed.initialize(
            model=actor.model, optimizer=torch.optim.AdamW(trained, lr=0.02), config=config)
        self.model_dir = model_dir
        from fastsync.moe.block import FastSyncMoEBlock

        blocks = {n: "fastsync" if isinstance(m, FastSyncMoEBlock) else type(m).__name__
                  for n, m in self.engine.module.named_modules() if n.endswith(".mlp")}
        return {"swapped": sorted(getattr(actor, "fastsync_moe_swapped", None) or {}), "blocks": blocks,
                "partitioned": partitioned}

    return build_actor


def lora_reference():
    """The trainer-rank call (by value, see :func:`calls`) that gathers the PEFT policy (collective)
    and, on rank 0, returns its greedy tokens (PEFT's own forward, adapters unmerged) and
    ``merge_and_unload()``'s weights."""

    def reference(self, lora: dict, prompts: list, max_tokens: int):
        import deepspeed
        import peft
        import torch
        import transformers

        from fastsync_rigs.openrlhf_cpu import hf_greedy

        params = list(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            full = {n: p.data.clone() for n, p in params} if self.rank == 0 else None
        if self.rank != 0:
            return None
        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(self.model_dir),
                                                             dtype=torch.float32)
        config = peft.LoraConfig(task_type="CAUSAL_LM", r=lora["lora_rank"], lora_alpha=lora["lora_alpha"],
                                 target_modules=lora["target_modules"], lora_dropout=0.0, bias="none")
        ref = peft.get_peft_model(base, config)
        ref.load_state_dict(full, strict=True)
        tokens = hf_greedy(ref.eval(), prompts, max_tokens)
        merged = {n: t.clone() for n, t in ref.merge_and_unload().state_dict().items()}
        lora_b = [t for n, t in full.items() if ".lora_B." in n]
        return {"tokens": tokens, "merged": merged, "lora_b_zero": all(bool((t == 0).all()) for t in lora_b),
                "num_lora_b": len(lora_b)}

    return reference
