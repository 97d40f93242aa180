"""TransformerEngine swaps for the dense parts of a MoE block (GPU only, when TE imports).

With ``backend="te"`` the block's dense ``nn.Linear`` layers (Qwen2-MoE's ``shared_expert``,
DeepSeek-V3's ``shared_experts``) become ``transformer_engine.pytorch.Linear`` modules holding the
same weights under the same names (``weight``, ``bias``) and shapes, so ``state_dict()`` is
unchanged; the routed experts run torch's CUDA ``grouped_mm``. Linears whose dimensions TE's
kernels do not take (not multiples of 16, e.g. the 1-wide ``shared_expert_gate``) stay torch.
RMSNorm lives in the decoder layer, outside the MoE block, and is not swapped here.

Where TE cannot run, asking for it is a ``MoEPatchError`` at patch time; ``"auto"`` then runs
the torch path and says so in one log line (see ``describe_backend``).
"""

from __future__ import annotations

import torch
from torch import nn

from fastsync.errors import MoEPatchError

__all__ = ["te_import_error", "require_te", "swap_linears"]


def te_import_error() -> str | None:
    """None when TransformerEngine can run here, else why not."""
    if not torch.cuda.is_available():
        return "CUDA is not available (TransformerEngine kernels are GPU-only)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as e:
        return f"transformer_engine.pytorch is not importable ({e}); pip install 'fastsync-rl[te]'"
    return None


def require_te() -> None:
    why = te_import_error()
    if why is not None:
        raise MoEPatchError(f"backend='te' requested but {why}")


def swap_linears(module: nn.Module) -> list[str]:
    """Replace each eligible ``nn.Linear`` under ``module`` by a TE Linear with the same
    parameters; returns the qualified names swapped. Call only after ``require_te()``."""
    import transformer_engine.pytorch as te

    swapped: list[str] = []
    targets = [
        (name, sub) for name, sub in module.named_modules()
        if type(sub) is nn.Linear and sub.in_features % 16 == 0 and sub.out_features % 16 == 0
    ]
    for name, lin in targets:
        new = te.Linear(
            lin.in_features, lin.out_features, bias=lin.bias is not None,
            params_dtype=lin.weight.dtype, device=lin.weight.device,
        )
        with torch.no_grad():
            new.weight.copy_(lin.weight)
            if lin.bias is not None:
                new.bias.copy_(lin.bias)
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, leaf, new)
        swapped.append(name)
    return swapped
