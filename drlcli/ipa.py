"""The Incremental Parallel Adapter (IPA) network (paper §III-B, SPEC §2.1).

A frozen PTM stream f_0 runs once. Each stage s owns a stream f_s computed in the same pass,
block by block next to the PTM stream. For blocks l = 1..L-1:

    v     = W_up · act(W_down · f_s^{l-1})              lightweight adapter, d→r→d
    a     = A^l ⊗ v                                      reusable attention (head h mixes slice h)
    g     = (1-γ)·f_{s-1}^l + γ·f_0^l                    gate input (f_0 for the first stage)
    M     = sigmoid(G_up · act(G_down · g))              transfer gate, d→r→d
    f_s^l = (1-M) ⊙ a + M ⊙ g                            ("adapt"; "sum" and "part" are ablations)

Block L is the transfer block (Interpretation I-1): the PTM's frozen attention sublayer reusing
A^L, then a new two-layer FFN d→d→d in place of the PTM's MLP, for the class token only. The
stage feature is final_norm(output). Earlier streams never depend on later ones, so adding a
stage leaves every older subspace unchanged.

Efficiency (Interpretation I-2): one pass produces every subspace. The adapters of all stages of a
block run as one batched matmul over stacked weights; only the gate, whose input is the previous
stage's output of the same block, is sequential over stages. The attention probabilities are
shared by all streams without copies.

Initialisation (Interpretation I-3): W_up, G_up and the FFN's second layer start at zero and the
gate bias at ``gate_bias_init`` (3.0: M = 0.95), so a new stream starts as 0.95·g at every block,
i.e. as the representation it inherits, and its transfer block as the PTM's attention sublayer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import backbone
from .config import IPAConfig

# Stage parameters stacked over blocks 1..L-1 (leading dim L-1), then the transfer FFN.
BLOCK_PARAMS = ("down", "down_bias", "up", "up_bias", "gate_down", "gate_down_bias", "gate_up", "gate_up_bias")
FFN_PARAMS = ("ffn_in", "ffn_in_bias", "ffn_out", "ffn_out_bias")


class StageAdapters(nn.Module):
    """One stage's trainable parameters: adapters and gates of blocks 1..L-1, transfer FFN."""

    def __init__(self, *, width: int, depth: int, adapter_dim: int, ffn_dim: int, gate_bias_init: float):
        super().__init__()
        n, d, r, f = depth - 1, width, adapter_dim, ffn_dim
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


class IPANetwork(nn.Module):
    """Frozen PTM + one ``StageAdapters`` per learned stage. ``forward`` gives all subspaces."""

    def __init__(self, ptm: nn.Module, cfg: IPAConfig):
        super().__init__()
        self.ptm = ptm
        self.cfg = cfg
        self.width = backbone.width(ptm)
        self.depth = len(ptm.blocks)
        self.num_heads = ptm.blocks[0].attn.num_heads
        self.adapter_dim = cfg.resolved_adapter_dim(self.width)
        self.ffn_dim = cfg.ffn_dim or self.width
        self.stages = nn.ModuleList()
        self._act = {"relu": F.relu, "gelu": F.gelu}[cfg.activation]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_subspaces(self) -> int:
        """Width of ``forward``'s subspace axis."""
        return 1 + len(self.stages)

    def new_stage(self, *, seed: int) -> StageAdapters:
        """Append a freshly initialised stage (seeded, on the PTM's device) and return it."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            stage = StageAdapters(
                width=self.width,
                depth=self.depth,
                adapter_dim=self.adapter_dim,
                ffn_dim=self.ffn_dim,
                gate_bias_init=self.cfg.gate_bias_init,
            )
        stage.to(next(self.ptm.parameters()).device)
        if self.cfg.gate == "sum":
            for name in ("gate_down", "gate_down_bias", "gate_up", "gate_up_bias"):
                getattr(stage, name).requires_grad_(False)
        self.stages.append(stage)
        return stage

    def forward(self, images: Tensor) -> Tensor:
        """Every subspace in one pass: (B, 1+S, d) = [f_0, f_1, ..., f_S]."""
        return self._run(images, train_last=False)

    def forward_train(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """(f_0, f_S) for training the newest stage; only f_S's stream carries gradients."""
        feats = self._run(images, train_last=True)
        return feats[:, 0], feats[:, -1]

    def _run(self, images: Tensor, *, train_last: bool) -> Tensor:
        frozen = list(self.stages[:-1] if train_last else self.stages)
        trainable = self.stages[-1] if train_last else None
        blocks = self.ptm.blocks
        with torch.no_grad():
            x0 = backbone.embed_tokens(self.ptm, images)  # (B, N, d): f^0 of every stream
            old = _stack(frozen)
            streams = x0.expand(len(frozen), *x0.shape) if frozen else None  # (S, B, N, d)
        new_params = _stack([trainable]) if trainable is not None else None
        new = x0.unsqueeze(0) if trainable is not None else None  # (1, B, N, d)
        for l, block in enumerate(blocks[:-1]):
            with torch.no_grad():
                x0_next, probs = backbone.block_with_attention(block, x0)
                if streams is not None:
                    streams = self._ipa_block(old, l, streams, probs, x0_next, prev=x0_next)
            if new is not None:
                prev = streams[-1] if streams is not None else x0_next
                new = self._ipa_block(new_params, l, new, probs, x0_next, prev=prev)
            x0 = x0_next
        with torch.no_grad():
            cls_probs, values = backbone.class_token_attention(blocks[-1], x0)
            feats = [backbone.ptm_class_feature(self.ptm, x0, cls_probs, values)]
            if streams is not None and not train_last:
                feats.extend(self._transfer(old, streams, cls_probs).unbind(0))
        if new is not None:
            feats.append(self._transfer(new_params, new, cls_probs)[0])
        return torch.stack(feats, dim=1)

    def _ipa_block(
        self, params: dict[str, Tensor], l: int, streams: Tensor, probs: Tensor, f0: Tensor, *, prev: Tensor
    ) -> Tensor:
        """Block l for S streams at once. streams (S, B, N, d) -> (S, B, N, d)."""
        num_stages, b, n, d = streams.shape
        # adapter for all stages in one batched matmul
        hidden = self._act(
            torch.einsum("sbnd,sdr->sbnr", streams, params["down"][:, l]) + params["down_bias"][:, l, None, None]
        )
        v = torch.einsum("sbnr,srd->sbnd", hidden, params["up"][:, l]) + params["up_bias"][:, l, None, None]
        if self.cfg.attention == "reuse":
            heads = v.view(num_stages, b, n, self.num_heads, d // self.num_heads).transpose(2, 3)
            a = (probs.unsqueeze(0) @ heads).transpose(2, 3).reshape(num_stages, b, n, d)  # A^l ⊗ v
        else:
            a = v
        gamma = self.cfg.gamma
        outs = []
        for s in range(num_stages):  # sequential: stage s's gate reads stage s-1's output
            g = (1.0 - gamma) * prev + gamma * f0
            if self.cfg.gate == "sum":  # no transfer gate: its parameters stay unused and frozen
                out = a[s] + g
            else:
                gate_hidden = self._act(g @ params["gate_down"][s, l] + params["gate_down_bias"][s, l])
                m = torch.sigmoid(gate_hidden @ params["gate_up"][s, l] + params["gate_up_bias"][s, l])
                out = (1.0 - m) * a[s] + m * g if self.cfg.gate == "adapt" else a[s] + m * g
            outs.append(out)
            prev = out
        return torch.stack(outs)

    def _transfer(self, params: dict[str, Tensor], streams: Tensor, cls_probs: Tensor) -> Tensor:
        """Transfer block for the class token of S streams: (S, B, N, d) -> features (S, B, d)."""
        block = self.ptm.blocks[-1]
        attn = block.attn
        d, heads = self.width, self.num_heads
        h = block.norm1(streams)
        # Σ_n A[0,n]·(W_v u_n + b_v) = W_v (Σ_n A[0,n] u_n) + b_v, since each row of A sums to 1:
        # mix the normalised tokens per head first, then project only the mixed vector.
        mixed = torch.einsum("bhn,sbnd->sbhd", cls_probs, h)  # (S, B, H, d)
        w_v = attn.qkv.weight[2 * d :].view(heads, d // heads, d)
        values = torch.einsum("sbhd,hkd->sbhk", mixed, w_v)  # (S, B, H, d/H)
        if attn.qkv.bias is not None:
            values = values + attn.qkv.bias[2 * d :].view(heads, d // heads)
        y = streams[:, :, 0] + block.ls1(attn.proj(attn.norm(values.flatten(2))))  # (S, B, d)
        hidden = F.gelu(torch.einsum("sbd,sdf->sbf", block.norm2(y), params["ffn_in"]) + params["ffn_in_bias"][:, None])
        y = y + torch.einsum("sbf,sfd->sbd", hidden, params["ffn_out"]) + params["ffn_out_bias"][:, None]
        return self.ptm.fc_norm(self.ptm.norm(y))


def _stack(stages: list[StageAdapters]) -> dict[str, Tensor]:
    """Each parameter stacked over stages: leading dim S. Empty dict when there are no stages."""
    if not stages:
        return {}
    return {name: torch.stack([getattr(st, name) for st in stages]) for name in BLOCK_PARAMS + FFN_PARAMS}
