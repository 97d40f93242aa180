"""Helpers shared by the MoE tests: tiny models with random weights and gradient comparisons."""

from __future__ import annotations

import copy

import torch
from torch import nn

from fastsync.moe.presets import ARCH_TINY, build_config


def tiny_model(arch: str, seed: int = 0, **overrides) -> nn.Module:
    """A tiny HF causal LM of ``arch`` with random (not HF-init) weights and eager experts."""
    from transformers import AutoModelForCausalLM

    cfg = build_config({**ARCH_TINY[arch], **overrides})
    cfg.output_router_logits = True
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if p.dim() >= 2 else 0.1)
            if "norm" in name and p.dim() == 1:
                p.add_(1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model.float()


def run(model: nn.Module, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Forward with labels (loss includes the router aux loss) and backward; (outputs, grads)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    outs = {"logits": out.logits.detach(), "loss": out.loss.detach()}
    if getattr(out, "aux_loss", None) is not None:  # DeepSeek-V3's CausalLM has no aux loss
        outs["aux_loss"] = out.aux_loss.detach()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return outs, grads


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for k in want:
        a, b = got[k].float(), want[k].float()
        assert a.shape == b.shape, (k, a.shape, b.shape)
        err = (a - b).abs().max().item()
        scale = b.abs().max().item()
        assert err <= rel * max(scale, 1e-6), f"{k}: max abs err {err:.3g} vs max |ref| {scale:.3g}"


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
