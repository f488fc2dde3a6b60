"""One stage's trainable parameters in the IPA network (``network.py``): the adapters and gates of
blocks 1..L-1, the transfer block's FFN, and under ``attention: learned`` its own queries and keys;
and every stage's parameters stacked for the one pass that computes all of their streams."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

# Stage parameters stacked over blocks 1..L-1 (leading dim L-1), then the transfer FFN.
BLOCK_PARAMS = ("down", "down_bias", "up", "up_bias", "gate_down", "gate_down_bias", "gate_up", "gate_up_bias")
FFN_PARAMS = ("ffn_in", "ffn_in_bias", "ffn_out", "ffn_out_bias")
ATTENTION_PARAMS = ("attn_q", "attn_q_bias", "attn_k", "attn_k_bias")  # attention: learned only


class StageAdapters(nn.Module):
    """One stage's trainable parameters: adapters and gates of blocks 1..L-1, transfer FFN."""

    def __init__(
        self, *, width: int, depth: int, adapter_dim: int, ffn_dim: int, gate_bias_init: float, attention_dim: int = 0
    ):
        super().__init__()
        n, d, r, f = depth - 1, width, adapter_dim, ffn_dim
        if attention_dim:  # attention: learned: heads·r query and key columns per block
            self.attn_q = nn.Parameter(_uniform((n, d, attention_dim), fan_in=d))
            self.attn_q_bias = nn.Parameter(torch.zeros(n, attention_dim))
            self.attn_k = nn.Parameter(_uniform((n, d, attention_dim), fan_in=d))
            self.attn_k_bias = nn.Parameter(torch.zeros(n, attention_dim))
        self.down = nn.Parameter(_uniform((n, d, r), fan_in=d))
        self.down_bias = nn.Parameter(torch.zeros(n, r))
        self.up = nn.Parameter(torch.zeros(n, r, d))
        self.up_bias = nn.Parameter(torch.zeros(n, d))
        self.gate_down = nn.Parameter(_uniform((n, d, r), fan_in=d))
        self.gate_down_bias = nn.Parameter(torch.zeros(n, r))
        self.gate_up = nn.Parameter(torch.zeros(n, r, d))
        self.gate_up_bias = nn.Parameter(torch.full((n, d), float(gate_bias_init)))
        self.ffn_in = nn.Parameter(_uniform((d, f), fan_in=d))
        self.ffn_in_bias = nn.Parameter(torch.zeros(f))
        self.ffn_out = nn.Parameter(torch.zeros(f, d))
        self.ffn_out_bias = nn.Parameter(torch.zeros(d))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _uniform(shape: tuple[int, ...], *, fan_in: int) -> Tensor:
    bound = 1.0 / math.sqrt(fan_in)  # nn.Linear's default init
    return torch.empty(shape).uniform_(-bound, bound)


def stack_stages(stages: list[StageAdapters], heads: int) -> dict[str, Tensor]:
    """Each parameter stacked over stages: leading dim S. Empty dict when there are no stages."""
    if not stages:
        return {}
    names = BLOCK_PARAMS + FFN_PARAMS + (ATTENTION_PARAMS if hasattr(stages[0], "attn_q") else ())
    stacked = {name: torch.stack([getattr(st, name) for st in stages]) for name in names}
    # the up-projections with their bias as one more input row; W_up split per head, (S, L-1, H, r+1, d/H);
    # the gate's negated, so that its sigmoid gives 1 - M directly
    up_aug = torch.cat([stacked["up"], stacked["up_bias"].unsqueeze(2)], dim=2)  # (S, L-1, r+1, d)
    s, blocks, rows, d = up_aug.shape
    stacked["up_heads"] = up_aug.view(s, blocks, rows, heads, d // heads).transpose(2, 3).contiguous()
    stacked["gate_up_neg"] = -torch.cat([stacked["gate_up"], stacked["gate_up_bias"].unsqueeze(2)], dim=2)
    for name in ("up", "up_bias", "gate_up", "gate_up_bias"):  # only their derived forms are used
        del stacked[name]
    return stacked
