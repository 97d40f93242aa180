"""Run by tests/layout/test_vllm_params.py as one of TP=2 processes: builds real vLLM 0.32 models
(no weights, no engine) for tiny configs and dumps every parameter's name and local shape.

argv: rank port cases.json out_dir. cases.json: [{"id": ..., "dir": ..., "ep": bool}, ...]
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main(rank: int, port: int, cases_path: str, out_dir: str) -> None:
    out: dict = {}
    try:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed import (
            destroy_distributed_environment,
            destroy_model_parallel,
            init_distributed_environment,
            initialize_model_parallel,
        )
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader.utils import initialize_model

        with open(cases_path) as f:
            cases = json.load(f)
        import time

        for case in cases:
            t0 = time.perf_counter()
            args = EngineArgs(model=case["dir"], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                              max_model_len=256, load_format="dummy", tensor_parallel_size=2,
                              enable_expert_parallel=case["ep"], distributed_executor_backend="mp")
            vc = args.create_engine_config()
            with set_current_vllm_config(vc):
                init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                             local_rank=rank, backend="gloo")
                initialize_model_parallel(2)
                torch.set_default_dtype(torch.bfloat16)
                model = initialize_model(vllm_config=vc)
                torch.set_default_dtype(torch.float32)
                out[case["id"]] = {n: [list(p.shape), str(p.dtype).removeprefix("torch.")]
                                   for n, p in model.named_parameters()}
                del model
                destroy_model_parallel()
                destroy_distributed_environment()
            port += 1
            print(f"case {case['id']}: {time.perf_counter() - t0:.1f} s", flush=True)
        result = {"ok": True, "params": out}
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc(), "params": out}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
