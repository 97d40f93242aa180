"""STAND-IN (see ``flash_attn/__init__.py``): flash-attn's pure-torch padding helpers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

__all__ = ["index_first_axis", "pad_input", "unpad_input", "rearrange"]


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)[indices].reshape(-1, *x.shape[1:])


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return (index_first_axis(rearrange(hidden_states, "b s ... -> (b s) ..."), indices), indices, cu_seqlens,
            max_seqlen_in_batch, used_seqlens_in_batch)


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    out = torch.zeros(batch * seqlen, *hidden_states.shape[1:], device=hidden_states.device,
                      dtype=hidden_states.dtype)
    out[indices] = hidden_states
    return rearrange(out, "(b s) ... -> b s ...", b=batch)


_ = repeat  # flash-attn's module exports it too
