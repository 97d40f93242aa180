"""Helpers shared by the MoE tests: tiny models with random weights and gradient comparisons."""

from __future__ import annotations

import copy

import torch
from torch import nn

from fastsync.moe.presets import ARCH_TINY, build_model


def tiny_model(arch: str, seed: int = 0, **overrides) -> nn.Module:
    """A tiny HF causal LM of ``arch`` with seeded random weights and HF's eager experts."""
    return build_model({**ARCH_TINY[arch], **overrides}, seed)


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
