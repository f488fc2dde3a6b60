"""Old classes carried across a stage that moves the network (issue 32; research in
``docs/research/adaptation-bounds.md`` at b4fbb16, eighth to eleventh rounds).

When a stage retrains the network the ridge head reads, the earlier classes' sums (G, Q) describe
features that no longer exist, and a run keeps no image to recompute them. What it can keep is
each class as a Gaussian of the head's input tokens (the class token and the layout cells: S
tokens of width d), taken once at the class's own stage, and move it with the network:

- ``TokenMaps``: one ridge map per token, fitted on the new stage's own images embedded before
  and after its training, y ≈ x + x B_t + b_t (B_t shrinks to 0 with λ: no move);
- ``ClassGaussians``: the classes of one stage, each as its mean, its ``rank`` leading
  covariance directions (scaled: draws are mean + zᵀF) and the spread σ of the rest (isotropic
  when taken). A move maps the mean and the directions by each token's map, and the isotropic
  rest by the product of the maps' linear parts, one per group of classes moved together. Draws from
  them stand in for the old classes' images when the head's sums are rebuilt;
- ``sums.expected_sums``: the ridge's statistics and the class covariances' moments that the
  classes' images would give, from draws of these Gaussians.

Pure tensor maths: ``stage.py`` puts it together for one stage of a carried run (the default's
schedule, ``Schedule.carries``); the research harness (``benchmarks/research/adapt`` at b4fbb16) replays its runs through it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ...linalg import ridge_map


@dataclass(frozen=True)
class TokenMaps:
    """One affine map per token: y_t = x_t + x_t B_t + b_t."""

    linear: Tensor  # (S, d, d): B_t
    shift: Tensor  # (S, d): b_t
    move: float  # the fitted images' mean relative squared move, Σ‖y − x‖² / Σ‖x‖² per image

    @classmethod
    def fit(cls, before: Tensor, after: Tensor, lam: float) -> TokenMaps:
        """From the same images' tokens (n, S, d) before and after a stage's training; λ absolute."""
        if before.shape != after.shape or before.dim() != 3:
            raise ValueError(
                f"before and after must be the same (n, S, d) tokens, not {before.shape} and {after.shape}"
            )
        if lam <= 0:
            raise ValueError(f"the maps' λ must be positive, not {lam}")
        parts = [ridge_map(before[:, t], after[:, t], lam) for t in range(before.shape[1])]
        moved = (after - before).pow(2).sum((1, 2)) / before.pow(2).sum((1, 2)).clamp_min(1e-30)
        return cls(
            torch.stack([b_mat for b_mat, _ in parts]),
            torch.stack([b for _, b in parts]),
            float(moved.mean()),
        )

    def __call__(self, rows: Tensor) -> Tensor:
        """(n, S, d) tokens moved."""
        return rows + torch.einsum("nsd,sde->nse", rows, self.linear) + self.shift


@dataclass(frozen=True)
class ClassGaussians:
    """Classes, each a Gaussian of its (S, d) tokens.

    A class's draw is mean + zᵀ F + ε L: z ~ N(0, I_r) over its ``ranks[c]`` directions
    (``factors[c, :ranks[c]]``), ε ~ N(0, σ_c² I) the isotropic rest, and L per token the product of
    every later map's I + B_t, shared by the classes that moved together: ``linears[groups[c]]``
    (``groups[c]`` −1 while no map has moved the class: L = I).
    """

    means: Tensor  # (C, S, d)
    factors: Tensor  # (C, r, S, d); rows past ranks[c] are zero
    ranks: Tensor  # (C,) int64
    spreads: Tensor  # (C,) σ of the isotropic rest (float64 whatever the rows' dtype)
    counts: Tensor  # (C,) int64: the images each class was taken from
    groups: Tensor  # (C,) int64: the class's row of ``linears``, or −1
    linears: Tensor  # (G, S, d, d)

    @classmethod
    def of(cls, rows: list[Tensor], rank: int) -> ClassGaussians:
        """One Gaussian per class from its rows (n_c, S, d): the mean, and when ``rank`` < n_c the
        ``rank`` leading directions of the centred rows / √(n_c − 1) with σ² the rest's mean
        energy per coordinate; else every centred row (σ 0: exact to the second moment)."""
        if not rows:
            raise ValueError("no class to take a Gaussian of")
        shape = tuple(rows[0].shape[1:])
        means, factors, spreads = [], [], []
        for class_rows in rows:
            if tuple(class_rows.shape[1:]) != shape or len(class_rows) == 0:
                raise ValueError(f"every class needs rows of shape (n > 0, {shape}), not {tuple(class_rows.shape)}")
            flat = class_rows.flatten(1)
            mean = flat.mean(0)
            factor = (flat - mean) / max(len(class_rows) - 1, 1) ** 0.5
            spread = 0.0
            if rank and rank < len(class_rows):
                _, sv, vh = torch.linalg.svd(factor, full_matrices=False)
                spread = (float((sv[rank:] ** 2).sum()) / flat.shape[1]) ** 0.5
                factor = sv[:rank, None] * vh[:rank]
            means.append(mean.view(shape))
            factors.append(factor.view(len(factor), *shape))
            spreads.append(spread)
        width = max(len(f) for f in factors)
        padded = torch.zeros(len(rows), width, *shape, dtype=rows[0].dtype)
        for c, factor in enumerate(factors):
            padded[c, : len(factor)] = factor
        return cls(
            torch.stack(means),
            padded,
            torch.tensor([len(f) for f in factors]),
            torch.tensor(spreads, dtype=torch.float64),
            torch.tensor([len(r) for r in rows]),
            torch.full((len(rows),), -1),
            torch.zeros(0, *shape[:1], shape[1], shape[1], dtype=rows[0].dtype),
        )

    def __len__(self) -> int:
        return len(self.means)

    @property
    def tokens(self) -> tuple[int, int]:
        return tuple(self.means.shape[1:])

    def moved(self, maps: TokenMaps, exact: bool = True) -> ClassGaussians:
        """Every class by ``maps``: its mean and directions, and (``exact``) its isotropic rest, whose
        L gains I + B_t (classes not moved before form one new group); ``exact`` False leaves the
        rest isotropic (L = I, no group)."""
        if tuple(maps.shift.shape) != self.tokens:
            raise ValueError(f"maps of tokens {tuple(maps.shift.shape)} cannot move Gaussians of {self.tokens}")
        means, factors = self.means.clone(), self.factors.clone()
        for c in range(len(self)):  # class by class, token by token: the research harness's own order of operations
            for t in range(self.tokens[0]):
                means[c, t] = means[c, t] + means[c, t] @ maps.linear[t] + maps.shift[t]
                factors[c, :, t] = factors[c, :, t] + factors[c, :, t] @ maps.linear[t]
        if not exact:
            return replace(self, means=means, factors=factors)
        groups, linears = self.groups.clone(), list(self.linears)
        if bool((groups < 0).any()):  # the classes not moved before: one new group, from I
            groups[groups < 0] = len(linears)
            linears.append(torch.eye(self.tokens[1], dtype=self.means.dtype).expand(self.tokens[0], -1, -1))
        steps = [torch.stack([lin[t] + lin[t] @ maps.linear[t] for t in range(self.tokens[0])]) for lin in linears]
        return replace(self, means=means, factors=factors, groups=groups, linears=torch.stack(steps))

    def to(self, device: torch.device | str) -> ClassGaussians:
        """The same Gaussians with every tensor on ``device``."""
        return replace(self, **{f: getattr(self, f).to(device) for f in _FIELDS.values()})

    def draw(self, c: int, number: int, generator: torch.Generator, *, first_only: bool = False) -> Tensor:
        """``number`` draws (number, S, d) of class ``c``, from ``generator`` (a CPU generator: the
        same numbers on every device), on the Gaussians' device; ``first_only``: of its first token
        alone, (number, 1, d), less work the more tokens the head reads (the same law as the whole
        draws' first token, another stream)."""
        dtype, device = self.means.dtype, self.means.device
        tokens = (1, self.tokens[1]) if first_only else self.tokens
        factor = self.factors[c, : int(self.ranks[c]), : tokens[0]].flatten(1)
        z = torch.randn(number, len(factor), generator=generator, dtype=dtype).to(device)
        noise = torch.randn(number, *tokens, generator=generator, dtype=dtype).to(device) * float(self.spreads[c])
        if int(self.groups[c]) >= 0:
            noise = torch.einsum("nsd,sde->nse", noise, self.linears[int(self.groups[c])][: tokens[0]])
        return (self.means[c, : tokens[0]].flatten() + z @ factor).view(number, *tokens) + noise

    def joined(self, other: ClassGaussians) -> ClassGaussians:
        """This object's classes, then ``other``'s (its groups after this one's)."""
        if self.tokens != other.tokens:
            raise ValueError(f"cannot join Gaussians of tokens {self.tokens} and {other.tokens}")
        width = max(self.factors.shape[1], other.factors.shape[1])
        return ClassGaussians(
            torch.cat([self.means, other.means]),
            torch.cat([_pad(self.factors, width), _pad(other.factors, width)]),
            torch.cat([self.ranks, other.ranks]),
            torch.cat([self.spreads, other.spreads]),
            torch.cat([self.counts, other.counts]),
            torch.cat([self.groups, torch.where(other.groups < 0, -1, other.groups + len(self.linears))]),
            torch.cat([self.linears, other.linears.to(self.linears)]),
        )

    def to_tensors(self, prefix: str) -> dict[str, Tensor]:
        return {f"{prefix}{name}": getattr(self, field) for name, field in _FIELDS.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], prefix: str) -> ClassGaussians:
        """``to_tensors``' inverse; every shape checked (ValueError names the first that is off)."""
        try:
            parts = {field: tensors[f"{prefix}{name}"] for name, field in _FIELDS.items()}
        except KeyError as missing:
            raise ValueError(f"class Gaussians lack {missing.args[0]}") from None
        means, factors, ranks = parts["means"], parts["factors"], parts["ranks"]
        if means.dim() != 3:
            raise ValueError(f"{prefix}mean must be (C, S, d), not {tuple(means.shape)}")
        classes, shape = len(means), tuple(means.shape[1:])
        linears = parts["linears"]
        expected = {
            "factor": (factors, (classes, factors.shape[1] if factors.dim() == 4 else -1, *shape)),
            "rank": (ranks, (classes,)),
            "spread": (parts["spreads"], (classes,)),
            "count": (parts["counts"], (classes,)),
            "group": (parts["groups"], (classes,)),
            "linear": (linears, (linears.shape[0] if linears.dim() == 4 else -1, shape[0], shape[1], shape[1])),
        }
        for name, (tensor, want) in expected.items():
            if tuple(tensor.shape) != want:
                raise ValueError(f"{prefix}{name} must be {want}, not {tuple(tensor.shape)}")
        _check_dtypes(parts, prefix)
        _check_values(parts, prefix)
        return cls(**parts)


_FIELDS = {  # stored name -> field
    "mean": "means",
    "factor": "factors",
    "rank": "ranks",
    "spread": "spreads",
    "count": "counts",
    "group": "groups",
    "linear": "linears",
}


def _check_dtypes(parts: dict[str, Tensor], prefix: str) -> None:
    """The rows (mean, factor, linear) in one floating dtype, float32 or float64 (a run's: float64), the
    spreads float64, the ranks, counts and groups int64, as ``of`` makes them; ValueError otherwise."""
    for name, field in _FIELDS.items():
        tensor, want = parts[field], parts["means"].dtype
        if field in ("ranks", "counts", "groups"):
            want = torch.int64
        elif field == "spreads" or want not in (torch.float32, torch.float64):
            want = torch.float64
        if tensor.dtype != want:
            kind = "integers" if want == torch.int64 else "floats"
            raise ValueError(f"{prefix}{name} must be {kind} ({want}), not {tensor.dtype}")


def _check_values(parts: dict[str, Tensor], prefix: str) -> None:
    """The values ``draw`` and ``joined`` index or scale by, within their ranges (a crafted carry
    could otherwise read past a factor or a group's map, or draw with a negative spread): the ranks
    within the factors' width, the counts positive, the groups -1 (none) or a map's, the spreads
    finite and not negative; ValueError names the first that is off."""
    ranks, factors, linears = parts["ranks"], parts["factors"], parts["linears"]
    if bool(((ranks < 0) | (ranks > factors.shape[1])).any()):
        raise ValueError(f"{prefix}rank must be integers within 0..{factors.shape[1]}")
    if bool((parts["counts"] < 1).any()):
        raise ValueError(f"{prefix}count must be positive integers")
    groups = parts["groups"]
    if bool(((groups < -1) | (groups >= len(linears))).any()):
        raise ValueError(f"{prefix}group must be integers within -1..{len(linears) - 1}")
    spreads = parts["spreads"]
    if not bool(torch.isfinite(spreads).all()) or bool((spreads < 0).any()):
        raise ValueError(f"{prefix}spread must be finite and not negative")


def _pad(factors: Tensor, width: int) -> Tensor:
    if factors.shape[1] == width:
        return factors
    out = factors.new_zeros(len(factors), width, *factors.shape[2:])
    out[:, : factors.shape[1]] = factors
    return out
