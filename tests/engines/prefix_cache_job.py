"""One process: a trainer rank (``WeightSync``) and a real vLLM CPU engine whose engine core and
worker run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as vLLM's API tests and the
reload bench run theirs), with vLLM's prefix cache on. Not a test module: run by
``test_vllm_prefix_cache.py``, prints one JSON line.

A prompt two KV blocks long is generated on the checkpoint's weights (its blocks enter the
prefix cache), then two syncs each bring a new random model:

* version 1 with ``LLM.reset_prefix_cache`` made a no-op: the control, showing that the engine
  does reuse cached blocks (the cached prompt's tokens are not the new model's, while a prompt
  never seen before gets the new model's tokens);
* version 2 as shipped: the flip drops the cache, so the tokens are the new model's.

argv: checkpoint directory.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def main(ckpt: str) -> None:
    import torch
    import transformers
    from vllm import LLM

    from fastsync.control import TCPStoreControl
    from fastsync.demo.run import engine_kwargs, hf_greedy
    from fastsync.engines.vllm.handle import VllmEngine
    from fastsync.layout.trainer import fsdp_layout
    from fastsync.layout.types import ParamSpec
    from fastsync.sync import WeightSync

    llm = LLM(**{**engine_kwargs(ckpt, 1, "float32"), "max_model_len": 512, "enable_prefix_caching": True},
              distributed_executor_backend="uni")
    block = llm.llm_engine.vllm_config.cache_config.block_size
    prompt = [(7 * i + 3) % 500 + 1 for i in range(2 * block + 5)]
    fresh = [(11 * i + 5) % 500 + 1 for i in range(2 * block + 5)]  # never generated before the flip
    engine = VllmEngine(llm)
    assert not engine._mp, "the engine core should run in this process"
    engine.generate([prompt], 8)  # fills the prefix cache with the checkpoint's KV

    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    full = {n: p.data for n, p in hf.named_parameters()}
    layout = fsdp_layout({n: ParamSpec(n, tuple(t.shape), "float32") for n, t in full.items()}, 1)
    control = TCPStoreControl.server(port=0)
    ws = WeightSync(rank=0, world_size=1, control=control, engines=[engine], transport="nixl", timeout_s=60,
                    layout=layout, sources=full, name="prefix-cache", control_port=control.port)
    out: dict = {"block_size": block, "prompt_len": len(prompt)}
    try:
        ws.setup()
        reset = llm.reset_prefix_cache
        for version in (1, 2):
            g = torch.Generator().manual_seed(100 + version)
            with torch.no_grad():  # a new model: every tensor redrawn at its own scale
                for t in full.values():
                    t.copy_(torch.randn(t.shape, generator=g) * (t.std() + 1e-2) + t.mean())
            if version == 1:
                llm.reset_prefix_cache = lambda *a, **k: True  # type: ignore[method-assign]  # the control
            ws.sync(version)
            llm.reset_prefix_cache = reset  # type: ignore[method-assign]
            got = engine.generate([prompt, fresh], 8)
            out[f"v{version}"] = {"engine": got[0], "trainer": hf_greedy(hf, [prompt], 8)[0], "version": engine.version(),
                                  "fresh_engine": got[1], "fresh_trainer": hf_greedy(hf, [fresh], 8)[0]}
    finally:
        ws.close()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
