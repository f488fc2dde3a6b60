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
block run as batched matmuls over stacked weights (stacked once and cached while the frozen stages
are unchanged); only the gate, whose input is the previous stage's output of the same block, is
sequential over stages. The attention probabilities are shared by all streams without copies, and
since each row sums to 1 they mix the r-wide adapter hidden (A·h, then W_up per head) rather than
the d-wide output. On CPU the passes over (B, N, d) memory cost more than the small matmuls, so
biases ride inside the matmuls, the gate is one fused lerp, and without autograd each block writes
in place into buffers reused block after block.

Two bodies compute a block, chosen explicitly: the in-place one above (inference), and a
functional one (autograd, and ``exportable`` networks: a traced or exported graph must neither
write into ``out=`` slices, which not every exporter keeps, nor read a cached copy of the
parameters). ``serving.exportable`` sets the flag while a graph is traced. Both share the adapter
hidden and the gate's mixing step. ``tests/test_ipa.py`` checks all of this against a
plain one-stage-at-a-time implementation of the equations; ``benchmarks/cost.py`` measures it.

The ablation ``attention: learned`` gives each stage, in blocks 1..L-1, a query and a key projection of its own
(r wide a head) over the frozen block's ``norm1`` of the stage's incoming stream: its own A_s^l = softmax(q kᵀ/√r)
mixes the adapter output instead of the PTM's A^l, at the cost of one (B, H, N, N) attention per stage and block.
It runs the functional body only.

Initialisation (Interpretation I-3): W_up, G_up and the FFN's second layer start at zero and the
gate bias at ``gate_bias_init`` (3.0: M = 0.95), so a new stream starts as 0.95·g at every block,
i.e. as the representation it inherits, and its transfer block as the PTM's attention sublayer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...ptm import backbone
from ...seeding import seeded
from . import IPAConfig
from .stage import StageAdapters, stack_stages


@dataclass(frozen=True)
class _Blocks:
    """The pass after block L-1: the PTM stream, the frozen stages' and the trained stage's streams."""

    x0: Tensor  # (B, N, d)
    streams: Tensor | None  # the frozen stages' (S, B, N, d) (or (B, N, d) while all equal f^0)
    new: Tensor | None  # the trained stage's
    probed: dict[int, Tensor]  # probe block -> its class token (B, d)


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
        # the functional path everywhere, for tracing and export (see the module docstring)
        self.exportable = False

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_subspaces(self) -> int:
        """Width of ``forward``'s subspace axis."""
        return 1 + len(self.stages)

    def new_stage(self, *, seed: int) -> StageAdapters:
        """Append a freshly initialised stage (seeded, on the PTM's device) and return it."""
        with seeded(seed):  # on the CPU, then moved
            stage = StageAdapters(
                width=self.width,
                depth=self.depth,
                adapter_dim=self.adapter_dim,
                ffn_dim=self.ffn_dim,
                gate_bias_init=self.cfg.gate_bias_init,
                attention_dim=self.num_heads * self.adapter_dim if self.cfg.attention == "learned" else 0,
            )
        stage.to(next(self.ptm.parameters()).device)
        if self.cfg.gate == "sum":
            for name in ("gate_down", "gate_down_bias", "gate_up", "gate_up_bias"):
                getattr(stage, name).requires_grad_(False)
        self.stages.append(stage)
        return stage

    def forward(
        self, images: Tensor, stages: int | None = None, layout: int = 0, probes: tuple[int, ...] = ()
    ) -> Tensor:
        """Every subspace in one pass: (B, 1+S, d) = [f_0, f_1, ..., f_S]; with ``stages`` k only the
        leading ones, (B, 1+k, d): later stages' streams are not computed (a head that reads f_0
        alone costs one bare PTM pass). A subspace never depends on later stages, so these equal
        the leading columns of the full output. With ``layout`` g > 0, the PTM's layout rows
        (``backbone.ptm_layout``, g² of them) follow the subspaces: (B, 1+k+g², d). With ``probes``
        (PTM block indices before the last), the class token after each of those blocks, through the
        final norm, follows last (``backbone.ptm_probe``): the open-set score reads them."""
        return self._run(images, train_last=False, keep=stages, layout=layout, probes=probes)

    def forward_train(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """(f_0, f_S) for training the newest stage; only f_S's stream carries gradients."""
        feats = self._run(images, train_last=True)
        return feats[:, 0], feats[:, -1]

    def _run(
        self,
        images: Tensor,
        *,
        train_last: bool,
        keep: int | None = None,
        layout: int = 0,
        probes: tuple[int, ...] = (),
    ) -> Tensor:
        frozen = list(self.stages[:-1] if train_last else self.stages)
        if keep is not None:
            frozen = frozen[:keep]
        trainable = self.stages[-1] if train_last else None
        with torch.no_grad():
            x0 = backbone.embed_tokens(self.ptm, images)  # (B, N, d): f^0 of every stream
            old = self._frozen_stack(frozen) if frozen else {}
        new_params = stack_stages([trainable], self.num_heads) if trainable is not None else None
        done = self._blocks(x0, old, new_params, probes=probes)
        with torch.no_grad():
            cls_probs, values = backbone.class_token_attention(self.ptm.blocks[-1], done.x0)
            feats = [backbone.ptm_class_feature(self.ptm, done.x0, cls_probs, values)]
            if done.streams is not None and not train_last:
                feats.extend(self._transfer(old, _streams(done.streams, len(frozen)), cls_probs).unbind(0))
        if done.new is not None:
            feats.append(self._transfer(new_params, _streams(done.new, 1), cls_probs)[0])
        return self._extra_rows(torch.stack(feats, dim=1), done, layout, probes)

    def _extra_rows(self, out: Tensor, done: _Blocks, layout: int, probes: tuple[int, ...]) -> Tensor:
        """The subspaces (B, S, d), then the PTM's layout rows (g > 0), then the probe blocks' tokens."""
        if layout:
            with torch.no_grad():
                out = torch.cat([out, backbone.ptm_layout(self.ptm, done.x0, layout)], dim=1)
        if probes:
            missing = sorted(set(probes) - set(done.probed))
            if missing:
                raise ValueError(f"PTM block {missing[0]} is not a block before the last of {len(self.ptm.blocks)}")
            out = torch.cat([out, torch.stack([done.probed[b] for b in probes], dim=1)], dim=1)
        return out

    def _blocks(
        self,
        x0: Tensor,
        old: dict[str, Tensor],
        new_params: dict[str, Tensor] | None,
        *,
        probes: tuple[int, ...],
    ) -> _Blocks:
        """Blocks 1 .. L-1 (Eq. 4-8): the PTM stream, the frozen stages' streams (no gradients) and the
        trainable stage's stream, block by block in one pass; the probe blocks' class tokens on the way.
        With no stream to compute (a head that reads the PTM alone), timm's own blocks run, with its
        fused attention: nothing reads the attention probabilities then."""
        streams: Tensor | None = x0 if old else None  # (B, N, d) while every stream equals f^0
        new: Tensor | None = x0 if new_params is not None else None
        workspace: dict[str, Tensor] = {}  # the frozen streams' buffers, reused block after block
        probed: dict[int, Tensor] = {}
        for l, block in enumerate(self.ptm.blocks[:-1]):
            with torch.no_grad():
                if streams is None and new is None:  # no stream reads the attention: timm's own (fused) block
                    x0_next, probs = block(x0), None
                else:
                    x0_next, probs = backbone.block_with_attention(block, x0)
                if l in probes:
                    probed[l] = backbone.ptm_probe(self.ptm, x0_next)
                if streams is not None:
                    streams = self._ipa_block(old, l, streams, probs, x0_next, prev=x0_next, workspace=workspace)
            if new is not None:
                prev = streams[-1] if streams is not None else x0_next
                new = self._ipa_block(new_params, l, new, probs, x0_next, prev=prev)
            x0 = x0_next
        return _Blocks(x0, streams, new, probed)

    def _frozen_stack(self, stages: list[StageAdapters]) -> dict[str, Tensor]:
        """``stack_stages(stages)``, cached while those parameters are unchanged (no copy per forward)."""
        if self.exportable:  # a traced/exported graph must read the parameters, not a cached copy
            return stack_stages(stages, self.num_heads)
        key = tuple((id(p), p._version, p.device, p.dtype) for st in stages for p in st.parameters())
        cached = self.__dict__.get("_stack_cache")
        if cached is None or cached[0] != key:
            cached = (key, stack_stages(stages, self.num_heads))
            self.__dict__["_stack_cache"] = cached
        return cached[1]

    def _ipa_block(
        self,
        params: dict[str, Tensor],
        l: int,
        streams: Tensor,
        probs: Tensor,
        f0: Tensor,
        *,
        prev: Tensor,
        workspace: dict[str, Tensor] | None = None,
    ) -> Tensor:
        """Block l for the S stages in ``params`` at once: (S, B, N, d) -> (S, B, N, d).

        ``streams`` may be one (B, N, d) tensor when every stream's input is the same (block 0).
        Tensors of width d are touched as few times as possible (on CPU these passes over memory,
        not the matmuls, dominate): the attention mixing runs on the r-wide hidden, the up-projection
        carries its bias, the gate is a fused lerp. Without autograd (and unless ``exportable``) the
        output is written in place into ``workspace`` buffers that the next block reuses
        (overwriting ``streams`` once read).
        """
        num_stages = params["down"].shape[0]
        b, n, d = f0.shape
        in_place = workspace is not None and not torch.is_grad_enabled() and not self.exportable
        if self.cfg.attention == "learned":  # each stage's own A, from its incoming stream
            in_place, probs = False, self._own_attention(params, l, streams)
        space = workspace if in_place else {}
        flat = self._adapter_hidden(params, l, streams, f0, space)  # (B, N, S·(r+1))
        up = params["up_heads"][:, l]  # (S, H, r+1, dh): each head's slice of [W_up; c]
        a = self._attend_in_place(flat, up, probs, f0, space) if in_place else self._attend(flat, up, probs, f0)
        outs = []
        for s in range(num_stages):  # sequential: stage s's gate reads stage s-1's output
            prev = self._gate(params, l, s, a[s], prev, f0, out=a[s] if in_place else None)
            outs.append(prev)
        if in_place:
            return a.view(num_stages, b, n, d)
        return outs[0].unsqueeze(0) if num_stages == 1 else torch.stack(outs)

    def _adapter_hidden(
        self, params: dict[str, Tensor], l: int, streams: Tensor, f0: Tensor, space: dict[str, Tensor]
    ) -> Tensor:
        """act(W_down·f + b) of every stage, with a column of ones: (B, N, S·(r+1)), token-major.

        [h, 1]·[W_up; c] carries the up-projection's bias inside the matmul, and since each row of
        A sums to 1, A·[h, 1] = [A·h, 1] keeps that column through the attention mixing."""
        num_stages, r = params["down"].shape[0], self.adapter_dim
        b, n, d = f0.shape
        down, down_bias = params["down"][:, l], params["down_bias"][:, l]
        hidden, fresh = _buffer(space, "hidden", f0, (b, n, num_stages, r + 1))  # f0's dtype, also under autocast
        if fresh:
            hidden[..., r] = 1.0
        if streams.dim() == 3:  # one input for every stage: one matmul against the stages' W_down side by side
            h = torch.addmm(down_bias.reshape(-1), streams.reshape(b * n, d), down.transpose(0, 1).reshape(d, -1))
            hidden[..., :r] = self._act(h).view(b, n, num_stages, r)
        else:
            h = torch.baddbmm(down_bias[:, None], streams.reshape(num_stages, b * n, d), down)
            hidden[..., :r] = self._act(h).view(num_stages, b, n, r).permute(1, 2, 0, 3)
        return hidden.view(b, n, num_stages * (r + 1))

    def _own_attention(self, params: dict[str, Tensor], l: int, streams: Tensor) -> Tensor:
        """``attention: learned``: each stage's softmax(q kᵀ/√r) over block l's ``norm1`` of its own
        incoming stream (S, B, N, d; one (B, N, d) for all at block 0), its q and k r wide a head:
        (S, B, H, N, N)."""
        num_stages, heads, r = params["attn_q"].shape[0], self.num_heads, self.adapter_dim
        x = _streams(self.ptm.blocks[l].norm1(streams), num_stages)  # normalised once, then shared
        b, n, d = x.shape[1:]
        x = x.reshape(num_stages, b * n, d)
        q = torch.baddbmm(params["attn_q_bias"][:, l, None], x, params["attn_q"][:, l])  # (S, B·N, H·r)
        k = torch.baddbmm(params["attn_k_bias"][:, l, None], x, params["attn_k"][:, l])
        q, k = (t.view(num_stages, b, n, heads, r).transpose(2, 3) for t in (q, k))  # (S, B, H, N, r)
        return torch.softmax(q @ k.transpose(-2, -1) * r**-0.5, dim=-1)

    def _attend_in_place(self, flat: Tensor, up: Tensor, probs: Tensor, f0: Tensor, space: dict[str, Tensor]) -> Tensor:
        """a = A ⊗ (W_up·h + c) per head, computed as W_up·(A h) + c (mixing the r-wide hidden costs
        H·r < d per token), with matmuls straight into token-major slices of a reused buffer: no
        copies. (S, B, N, H, dh)."""
        num_stages, heads, r1, dh = up.shape  # r1 = r + 1
        b, n, _ = f0.shape
        if self.cfg.attention == "reuse":
            mixed, _ = _buffer(space, "mixed", f0, (heads, b, n, num_stages * r1))
            for k in range(heads):  # (probs are bf16 under autocast; the streams stay in f0's dtype)
                torch.bmm(probs[:, k].to(f0.dtype), flat, out=mixed[k])
            mixed = mixed.view(heads, b, n, num_stages, r1)
        else:
            mixed = flat.view(b, n, num_stages, r1).unsqueeze(0).expand(heads, b, n, num_stages, r1)
        a, _ = _buffer(space, "streams", f0, (num_stages, b * n, heads, dh))
        up = up.to(f0.dtype)
        for s in range(num_stages):  # heads as the batch: (H, B·N, r+1) @ (H, r+1, dh), views only
            torch.bmm(mixed[:, :, :, s].reshape(heads, b * n, r1), up[s], out=a[s].transpose(0, 1))
        return a.view(num_stages, b, n, heads, dh)

    def _attend(self, flat: Tensor, up: Tensor, probs: Tensor, f0: Tensor) -> Tensor:
        """What ``_attend_in_place`` computes, functionally (autograd, export): batched matmuls and a
        strided (S, B, N, H, dh) view."""
        num_stages, heads, r1, dh = up.shape
        b, n, _ = f0.shape
        if self.cfg.attention == "reuse":
            mixed = (probs.reshape(b, heads * n, n) @ flat).view(b, heads, n, num_stages, r1)
            lhs = mixed.permute(3, 1, 0, 2, 4)  # (S, H, B, N, r+1)
        elif self.cfg.attention == "learned":  # probs: each stage's own, (S, B, H, N, N)
            hidden = flat.view(b, n, num_stages, r1).permute(2, 0, 1, 3).unsqueeze(2)  # (S, B, 1, N, r+1)
            lhs = (probs.to(flat.dtype) @ hidden).transpose(1, 2)  # (S, H, B, N, r+1)
        else:
            hidden = flat.view(b, n, num_stages, r1)
            lhs = hidden.permute(2, 0, 1, 3).unsqueeze(1).expand(num_stages, heads, b, n, r1)
        lhs = lhs.reshape(num_stages * heads, b * n, r1)
        a = torch.bmm(lhs, up.reshape(num_stages * heads, r1, dh))
        return a.view(num_stages, heads, b, n, dh).permute(0, 2, 3, 1, 4).to(f0.dtype)

    def _gate(
        self, params: dict[str, Tensor], l: int, s: int, a_s: Tensor, prev: Tensor, f0: Tensor, *, out: Tensor | None
    ) -> Tensor:
        """The transfer gate's mixing step for stage s, shared by both paths: f_s = (1-M)·a + M·g
        (``adapt``; ``sum``: a + g; ``part``: a + M·g), written into ``out`` when given. (B, N, d)."""
        b, n, d = f0.shape
        heads, r = self.num_heads, self.adapter_dim
        # g = (1-γ)·prev + γ·f0 (= f0 for the first stage, whose prev is f0)
        g = f0 if prev is f0 else torch.lerp(prev, f0, self.cfg.gamma)
        g4 = g.view(b, n, heads, d // heads)
        if self.cfg.gate == "sum":  # no transfer gate: its parameters stay unused and frozen
            return torch.add(g4, a_s, out=out).reshape(b, n, d)
        gate_hidden = g.new_empty(b * n, r + 1)
        gate_hidden[:, r] = 1.0
        gate_hidden[:, :r] = self._act(
            torch.addmm(params["gate_down_bias"][s, l], g.reshape(b * n, d), params["gate_down"][s, l])
        )
        # 1 - M = sigmoid(-(G_up·h + bias)): the bias rides in the matmul, and g leads the
        # elementwise op so the result is laid out like g when a is a strided view
        keep = torch.mm(gate_hidden, params["gate_up_neg"][s, l]).sigmoid_().view(b, n, heads, d // heads)
        if self.cfg.gate == "adapt":  # (1-M)·a + M·g = g + (1-M)·(a - g)
            return torch.lerp(g4, a_s, keep.to(g.dtype), out=out).reshape(b, n, d)
        return torch.addcmul(a_s, 1.0 - keep.to(g.dtype), g4, out=out).reshape(b, n, d)  # part: a + M·g

    def _transfer(self, params: dict[str, Tensor], streams: Tensor, cls_probs: Tensor) -> Tensor:
        """Transfer block for the class token of S streams: (S, B, N, d) -> features (S, B, d)."""
        block = self.ptm.blocks[-1]
        attn = block.attn
        d, heads = self.width, self.num_heads
        # Σ_n A[0,n]·(W_v u_n + b_v) = W_v (Σ_n A[0,n] u_n) + b_v, since each row of A sums to 1:
        # mix the normalised tokens per head first, then project only the mixed vector. One stream
        # at a time, so that only one normalised (B, N, d) copy exists at once.
        mixed = torch.stack([cls_probs @ block.norm1(stream) for stream in streams])  # (S, B, H, d)
        w_v = attn.qkv.weight[2 * d :].view(heads, d // heads, d)
        values = torch.einsum("sbhd,hkd->sbhk", mixed, w_v)  # (S, B, H, d/H)
        if attn.qkv.bias is not None:
            values = values + attn.qkv.bias[2 * d :].view(heads, d // heads)
        y = streams[:, :, 0] + block.ls1(attn.proj(attn.norm(values.flatten(2))))  # (S, B, d)
        hidden = F.gelu(torch.einsum("sbd,sdf->sbf", block.norm2(y), params["ffn_in"]) + params["ffn_in_bias"][:, None])
        y = y + torch.einsum("sbf,sfd->sbd", hidden, params["ffn_out"]) + params["ffn_out_bias"][:, None]
        return self.ptm.fc_norm(self.ptm.norm(y))


def _buffer(workspace: dict[str, Tensor], name: str, like: Tensor, shape: tuple[int, ...]) -> tuple[Tensor, bool]:
    """``workspace[name]`` if it has this shape, else a new tensor kept there; and whether it is new.
    Reusing buffers block after block spares the page faults that fresh memory of this size costs."""
    buf = workspace.get(name)
    if buf is not None and buf.shape == shape and buf.dtype == like.dtype and buf.device == like.device:
        return buf, False
    buf = workspace[name] = like.new_empty(shape)
    return buf, True


def _streams(streams: Tensor, num_stages: int) -> Tensor:
    """(S, B, N, d) streams; a (B, N, d) tensor (no block ran yet) stands for S equal ones."""
    return streams if streams.dim() == 4 else streams.expand(num_stages, *streams.shape)
