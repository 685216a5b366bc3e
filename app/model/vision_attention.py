"""The Qwen3-VL vision tower's attention over many same-sized pictures in one call.

Without flash-attention, transformers' Qwen3-VL vision attention attends one picture at a time: a Python loop
of attention calls over the cu_seqlens chunks. A training step of the learning run feeds ~300 maze pictures,
so it made 1,296 attention calls (pictures x vision layers), and on the H200 that step was bound by kernel
launches, not by the GPU (docs/BENCHMARKS.md, "SFT and see steps"). The pictures of a run all have one
size, so the chunks stack into one [pictures, heads, patches, head_dim] batch and a single
scaled_dot_product_attention computes the same attention. Pictures of different sizes, and flash-attention
(whose varlen kernel already takes every chunk at once), keep the library's own forward.

Written here because nothing in transformers does it: its only one-call path over many pictures is
flash-attention's varlen kernel, which these machines do not have.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionAttention, apply_rotary_pos_emb_vision


def batched_vision_attention(
    self,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen: int | None = None,
    **kwargs,
) -> torch.Tensor:
    """Qwen3VLVisionAttention.forward, with equal-length chunks attended in one batched call."""

    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    patches = int(lengths[0])
    if not bool((lengths == patches).all()):
        return type(self).forward(
            self, hidden_states, cu_seqlens, position_embeddings=position_embeddings, max_seqlen=max_seqlen, **kwargs
        )
    seq_length = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    # [pictures * patches, heads, head_dim] -> [pictures, heads, patches, head_dim]: picture i's patches are the
    # i-th run of `patches` rows, exactly the library's cu_seqlens chunks
    q, k, v = (t.reshape(lengths.numel(), patches, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
    dropout = self.attention_dropout if self.training else 0.0
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=self.scaling)
    return self.proj(out.transpose(1, 2).reshape(seq_length, -1))


def use_batched_vision_attention(model) -> int:
    """Routes every vision attention module of `model` through batched_vision_attention; returns how many.

    Only for the sdpa and eager implementations (the ones that loop); flash-attention is left alone.
    """

    count = 0
    for module in model.modules():
        if isinstance(module, Qwen3VLVisionAttention) and module.config._attn_implementation in ("sdpa", "eager"):
            module.forward = types.MethodType(batched_vision_attention, module)
            count += 1
    return count
