"""Routing replay: record the experts each MoE block chose at rollout, reuse them in training.

RL hosts that want the trainer to route tokens exactly as the rollout engine did pass the
routes they recorded (per block name, one ``(num_tokens, top_k)`` index tensor per forward call)
and set replay mode. The router still runs (its logits feed the aux loss and its gradients), but
the chosen experts are the recorded ones; the routing weights are recomputed from this step's
router logits at those experts with the architecture's own rule (softmax / sigmoid,
top-k normalisation, scaling), so router gradients flow as usual.

Limitation: with activation checkpointing the recomputed forward calls each block again and
would consume (or record) a second route; replay with checkpointing is not supported yet.

Example::

    replay = RoutingReplay()
    fastsync.moe.patch(model, replay=replay)
    replay.record()                 # rollout-side forward(s) on the same model
    model(input_ids)
    routes = replay.routes()        # {block name: [idx_TK, ...]}; or supplied by the host
    replay.replay(routes)           # training forward(s) use these experts, in call order
    loss = model(input_ids, labels=labels).loss; loss.backward(); optimizer.step()
    replay.off()
"""

from __future__ import annotations

import torch
from torch import nn

from fastsync.errors import MoEPatchError

__all__ = ["RoutingReplay", "replay_weights"]


def replay_weights(rule: str, router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Routing weights at experts ``idx`` from router ``logits``, by the architecture's rule.

    ``rule``: ``"softmax"`` (Qwen2/Qwen3-MoE: softmax, optional top-k renorm, cast back),
    ``"mixtral"`` (softmax in fp32, always renormalised), ``"sigmoid_group"`` (DeepSeek-V3:
    sigmoid scores, optional renorm, routed scaling), ``"topk_softmax"`` (GPT-OSS: softmax over
    the chosen logits).
    """
    if rule == "softmax":
        w = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, idx)
        if router.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(logits.dtype)
    if rule == "mixtral":
        w = torch.softmax(logits.float(), dim=-1).gather(1, idx)
        return w / w.sum(dim=-1, keepdim=True)
    if rule == "sigmoid_group":
        w = logits.sigmoid().gather(1, idx)
        if router.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * router.routed_scaling_factor
    if rule == "topk_softmax":
        top = logits.gather(1, idx)
        return torch.softmax(top, dim=1, dtype=top.dtype)
    raise MoEPatchError(f"unknown routing-replay rule {rule!r}")


class RoutingReplay:
    """Holds recorded routes and the mode (``"off"``, ``"record"``, ``"replay"``)."""

    def __init__(self) -> None:
        self.mode = "off"
        self._routes: dict[str, list[torch.Tensor]] = {}
        self._cursor: dict[str, int] = {}

    def record(self) -> None:
        """Start recording; forgets earlier routes."""
        self.mode = "record"
        self._routes = {}

    def replay(self, routes: dict[str, list[torch.Tensor]] | None = None) -> None:
        """Replay ``routes`` (default: what was recorded), each block's list in call order."""
        if routes is not None:
            self._routes = {k: list(v) for k, v in routes.items()}
        self._cursor = {}
        self.mode = "replay"

    def off(self) -> None:
        self.mode = "off"

    def routes(self) -> dict[str, list[torch.Tensor]]:
        return {k: list(v) for k, v in self._routes.items()}

    def route(
        self, block: str, rule: str, router: nn.Module, logits: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Called by each patched block after its router: returns the (indices, weights) to use."""
        if self.mode == "record":
            self._routes.setdefault(block, []).append(idx.detach().clone())
            return idx, weights
        if self.mode != "replay":
            return idx, weights
        calls = self._routes.get(block)
        n = self._cursor.get(block, 0)
        if calls is None or n >= len(calls):
            raise MoEPatchError(f"routing replay: no recorded route for block {block!r} call {n}")
        self._cursor[block] = n + 1
        got = calls[n].to(device=idx.device, dtype=idx.dtype)
        if got.shape != idx.shape:
            raise MoEPatchError(
                f"routing replay: block {block!r} call {n} recorded indices {tuple(got.shape)}, "
                f"router produced {tuple(idx.shape)}"
            )
        return got, replay_weights(rule, router, logits, got)
