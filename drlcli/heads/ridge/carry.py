"""Old classes carried across a stage that moves the network (issue 32; research in
``docs/research/adaptation-bounds.md``, eighth to eleventh rounds).

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
- ``expected_sums``: the ridge's statistics (Q and G, fit and held-out parts) and the class
  covariances' moments of x = f_0/‖f_0‖ that the classes' images would give, estimated from
  ``draws`` times as many draws as each class had images; or (drl's presets) with E[φ] in closed
  form (``relu_means``) and the Grams centred on it, from fewer draws.

Pure tensor maths: ``carried.py`` puts it together for one stage of a carried run (``ranpac
--preset carried``); the research harness (``benchmarks/research/adapt``) replays its runs through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..linalg import ridge_map
from . import COV_COVARIANCE, COV_FACTOR, COV_MEAN, COV_TRACE
from .covariance import class_factors, covariance_input
from .head import expand, head_input
from .statistics import STAT_DTYPE, Statistics

CHUNK = 8192  # draws a class at a time; above it the draws come in chunks (another random stream)


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

    def draw(self, c: int, number: int, generator: torch.Generator) -> Tensor:
        """``number`` draws (number, S, d) of class ``c``, from ``generator`` (a CPU generator: the
        same numbers on every device), on the Gaussians' device."""
        dtype, device = self.means.dtype, self.means.device
        factor = self.factors[c, : int(self.ranks[c])].flatten(1)
        z = torch.randn(number, len(factor), generator=generator, dtype=dtype).to(device)
        noise = torch.randn(number, *self.tokens, generator=generator, dtype=dtype).to(device) * float(self.spreads[c])
        if int(self.groups[c]) >= 0:
            noise = torch.einsum("nsd,sde->nse", noise, self.linears[int(self.groups[c])])
        return (self.means[c].flatten() + z @ factor).view(number, *self.tokens) + noise

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
        if ranks.dtype.is_floating_point or bool(((ranks < 0) | (ranks > factors.shape[1])).any()):
            raise ValueError(f"{prefix}rank must be integers within 0..{factors.shape[1]}")
        if parts["counts"].dtype.is_floating_point or bool((parts["counts"] < 1).any()):
            raise ValueError(f"{prefix}count must be positive integers")
        groups = parts["groups"]
        if groups.dtype.is_floating_point or bool(((groups < -1) | (groups >= len(linears))).any()):
            raise ValueError(f"{prefix}group must be integers within -1..{len(linears) - 1}")
        spreads = parts["spreads"]
        if not bool(torch.isfinite(spreads).all()) or bool((spreads < 0).any()):
            raise ValueError(f"{prefix}spread must be finite and not negative")
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


def _pad(factors: Tensor, width: int) -> Tensor:
    if factors.shape[1] == width:
        return factors
    out = factors.new_zeros(len(factors), width, *factors.shape[2:])
    out[:, : factors.shape[1]] = factors
    return out


@dataclass(frozen=True)
class DrawnSums:
    """What ``fit_stage`` sums over a stage's images, for carried classes: their ``Statistics`` (Q's
    columns in the Gaussians' class order), the mean and covariance of each class's x, and the
    within-class scatter Σ (n_c − 1)·S_c over them (n_c the images each class had)."""

    statistics: Statistics
    x_means: Tensor  # (C, d)
    x_covariances: Tensor  # (C, d, d)
    scatter: Tensor  # (d, d)
    counts: Tensor  # (C,) the images each class had

    def covariance_rows(self, rank: int) -> dict[str, Tensor]:
        """The classes' covariance rows as a stage's weights hold its own (float32): μ_c, and S_c
        (``rank`` 0) or its rank-r factor and trace (``covariance.class_factors``)."""
        if not rank:
            return {COV_MEAN: self.x_means.float(), COV_COVARIANCE: self.x_covariances.float()}
        images = self.counts.to(STAT_DTYPE)
        factors, traces = class_factors(self.x_covariances * (images - 1).clamp_min(1)[:, None, None], images, rank)
        return {COV_MEAN: self.x_means.float(), COV_FACTOR: factors.float(), COV_TRACE: traces.float()}


def expected_sums(
    gaussians: ClassGaussians,
    parts: Tensor,
    *,
    projection: Tensor,
    layout_cells: int,
    draws: int,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
    exact_mean: bool = False,
    gram_draws: int | None = None,
) -> DrawnSums:
    """Each class's expected contribution to the ridge's sums from ``draws`` · n_c draws of it:
    Q_part = n_part · E[φ], G_part = Σ n_part · E[φ φᵀ], with φ = ReLU(h R) of the drawn tokens
    (``head_input``, ``projection`` R (S·d or the head's input width, M)); ``parts`` (C, 2) the
    class's fit and held-out image counts. In STAT_DTYPE; classes in order, from one ``generator``
    (on the CPU: the same draws on every device). The sums are taken on ``device`` when it is a CUDA
    device (the run's: the M x M products are most of a carried stage's time on a CPU; other
    accelerators may lack float64, so the CPU there) and returned on the CPU.

    ``exact_mean`` (``ranpac.carry_mean exact``): E[φ] = m in closed form (``relu_means``), and the
    Grams as n_part · (E[(φ − m)(φ − m)ᵀ] + m mᵀ): the draws enter only by their deviations from the
    known mean: no error term linear in them, so fewer draws give the same error. ``gram_draws`` (with
    ``exact_mean``): the Grams from about that many of the draws in all, each class's share in
    proportion to its images (at least one; never more than it drew), so that their M × M products
    cost the same however many images the classes had; None: from every draw. The class moments of x
    are always taken from every draw (d × d a draw, not M × M)."""
    if parts.shape != (len(gaussians), 2):
        raise ValueError(f"parts must be (classes, 2) = ({len(gaussians)}, 2), not {tuple(parts.shape)}")
    if draws < 1:
        raise ValueError(f"draws must be at least 1, not {draws}")
    if gram_draws is not None and (gram_draws < 1 or not exact_mean):
        raise ValueError(f"gram_draws must be at least 1 and needs exact_mean, not {gram_draws}")
    device = device if torch.device(device).type == "cuda" else "cpu"
    gaussians, projection = gaussians.to(device), projection.to(device, STAT_DTYPE)
    width, size = projection.shape
    d = gaussians.tokens[1]
    zeros = {"dtype": STAT_DTYPE, "device": projection.device}
    q = torch.zeros(2, size, len(gaussians), **zeros)
    grams = torch.zeros(2, size, size, **zeros)
    means = torch.zeros(len(gaussians), d, **zeros)
    covariances = torch.zeros(len(gaussians), d, d, **zeros)
    scatter = torch.zeros(d, d, **zeros)
    second = torch.empty(size, size, **zeros)  # one class's Σ φφᵀ (or of φ − m), reused
    total = float(gaussians.counts.sum())
    exact = relu_means(gaussians, projection, layout_cells) if exact_mean else None
    for c in range(len(gaussians)):
        images = int(gaussians.counts[c])
        number = draws * images
        # the draws whose φ the sums read: every one, or the class's share of gram_draws
        read = number if gram_draws is None else min(number, max(1, round(gram_draws * images / total)))
        first = torch.zeros(size, **zeros)
        second.zero_()
        x_scatter = torch.zeros(d, d, **zeros)
        for start in range(0, number, CHUNK):
            samples = gaussians.draw(c, min(CHUNK, number - start), generator).to(STAT_DTYPE)
            x = covariance_input(samples)
            mean = x.mean(0)
            centred = x - mean
            # the chunks' centred scatters joined (Chan et al.): positive semi-definite by construction
            step = mean - means[c]
            x_scatter += centred.T @ centred + torch.outer(step, step) * start * len(x) / (start + len(x))
            means[c] += step * len(x) / (start + len(x))
            if start >= read:
                continue
            phi = expand(head_input(samples[: read - start], width, layout_cells), projection)
            if exact is None:
                first += phi.sum(0)
                second += phi.T @ phi
            else:
                phi -= exact[c]
                second.addmm_(phi.T, phi)
        covariances[c] = x_scatter / max(number - 1, 1)
        scatter += (images - 1) * covariances[c]
        for part in range(2):
            if exact is None:
                q[part][:, c] = int(parts[c, part]) * first / read
                grams[part] += int(parts[c, part]) * second / read
            else:  # in place: an M x M temporary a class costs as much as its draws' products at a few draws
                grams[part].add_(second, alpha=int(parts[c, part]) / read)
    if exact is not None:
        for part in range(2):
            weights = parts[:, part].to(**zeros)
            q[part] = (exact * weights[:, None]).T
            grams[part].addmm_(exact.T * weights, exact)  # Σ_c n_part m mᵀ, one product for every class
    counts = parts.to(STAT_DTYPE).sum(0)
    q, grams = q.cpu(), grams.cpu()
    statistics = Statistics(grams[0], grams[1], q[0], q[1], float(counts[0]), float(counts[1]))
    return DrawnSums(statistics, means.cpu(), covariances.cpu(), scatter.cpu(), gaussians.counts.clone().cpu())


def relu_means(gaussians: ClassGaussians, projection: Tensor, layout_cells: int) -> Tensor:
    """E[φ] = E[ReLU(h R)] of each class in closed form, (C, M) in the projection's dtype: h R is
    Gaussian, so each coordinate a ~ N(μ, s²) has E[ReLU(a)] = μ Φ(μ/s) + s ϕ(μ/s) (ReLU(μ) where s
    is 0). μ = mean(h) R; s² the column sums of (F_h R)² over the class's directions plus σ_c² Σ_t
    ‖L_t R_t‖² over the tokens h reads (R_t: R's rows of token t; L_t the class's group's map, or I)."""
    width, size = projection.shape
    count, d = gaussians.tokens
    read = head_input(torch.arange(count, dtype=torch.float64)[None, :, None].expand(1, count, d), width, layout_cells)
    tokens = [int(t) for t in read[0, ::d]]  # the tokens h reads, in its order (R's row blocks)
    if len(set(tokens)) != len(tokens):  # each block's noise is its own token's: a token read twice is not
        raise ValueError(f"the head reads tokens {tokens}: a closed-form mean needs each token once")
    blocks = projection.view(len(tokens), d, size)
    plain = blocks.pow(2).sum((0, 1))  # L = I: Σ_t ‖R_t‖² per column
    grouped = [
        sum((linear[t].to(projection) @ blocks[i]).pow(2).sum(0) for i, t in enumerate(tokens))
        for linear in gaussians.linears
    ]
    out = torch.empty(len(gaussians), size, dtype=projection.dtype, device=projection.device)
    for c in range(len(gaussians)):
        mu = head_input(gaussians.means[c : c + 1].to(projection), width, layout_cells) @ projection
        rank = int(gaussians.ranks[c])
        variance = torch.zeros(size, dtype=projection.dtype, device=projection.device)
        if rank:
            variance += (
                (head_input(gaussians.factors[c, :rank].to(projection), width, layout_cells) @ projection).pow(2).sum(0)
            )
        group = int(gaussians.groups[c])
        variance += float(gaussians.spreads[c]) ** 2 * (grouped[group] if group >= 0 else plain)
        s = variance.sqrt()
        ratio = mu[0] / s.clamp_min(1e-300)
        value = mu[0] * torch.special.ndtr(ratio) + s * torch.exp(-0.5 * ratio.pow(2)) / math.sqrt(2 * math.pi)
        out[c] = torch.where(s > 0, value, mu[0].clamp_min(0))
    return out
