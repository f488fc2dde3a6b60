"""The ridge head's sums that carried classes' images would give (issue 32; ``gaussians.py`` keeps the
classes as Gaussians and moves them): ``expected_sums``, the ridge's statistics (Q and G, fit and
held-out parts) and the class covariances' moments of x = f_0/‖f_0‖, estimated from ``draws`` times
as many draws as each class had images; or (drl's presets) with E[φ] in closed form
(``relu_means``), the Grams centred on it, from fewer draws, and each class's draws split between
the fit and held-out Grams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import COV_COVARIANCE, COV_FACTOR, COV_MEAN, COV_TRACE
from ..covariance import class_factors, covariance_input
from ..head import expand, head_input
from ..statistics import STAT_DTYPE, Statistics
from .gaussians import ClassGaussians

CHUNK = 8192  # draws a class at a time; above it the draws come in chunks (another random stream)


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
    split_rows: bool = False,
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
    are always taken from every draw (d × d a draw, not M × M).

    ``split_rows`` (with ``exact_mean``): each class's draws read for the Grams are split between the
    fit and held-out Grams in proportion to its images in each (each row weighted n_part / its rows:
    the two Grams' sum reads every row at n / read as before) and the rows of many classes go into one
    product a part, so no class costs an M × M pass of its own; False: every read row enters both
    Grams, one M × M sum a class."""
    _check_options(gaussians, parts, draws, gram_draws=gram_draws, exact_mean=exact_mean, split_rows=split_rows)
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
    total = float(gaussians.counts.sum())
    exact = relu_means(gaussians, projection, layout_cells) if exact_mean else None
    sink = _Split(grams, parts) if split_rows else _Shared(grams, q, parts, centred=exact is not None)
    drawer = _Drawer(gaussians, projection, width, layout_cells, generator, sink, exact)
    for c in range(len(gaussians)):
        images = int(gaussians.counts[c])
        number = draws * images
        # the draws whose φ the sums read: every one, or the class's share of gram_draws
        read = number if gram_draws is None else min(number, max(1, round(gram_draws * images / total)))
        sink.start(c, read)
        x_scatter = drawer.draw_class(c, read, number, means[c])
        covariances[c] = x_scatter / max(number - 1, 1)
        scatter += (images - 1) * covariances[c]
        sink.end()
    sink.flush()
    if exact is not None:
        _add_exact_means(q, grams, exact, parts)
    counts = parts.to(STAT_DTYPE).sum(0)
    q, grams = q.cpu(), grams.cpu()
    statistics = Statistics(grams[0], grams[1], q[0], q[1], float(counts[0]), float(counts[1]))
    return DrawnSums(statistics, means.cpu(), covariances.cpu(), scatter.cpu(), gaussians.counts.clone().cpu())


def _check_options(
    gaussians: ClassGaussians,
    parts: Tensor,
    draws: int,
    *,
    gram_draws: int | None,
    exact_mean: bool,
    split_rows: bool,
) -> None:
    """``expected_sums``' arguments, checked before any draw: ValueError names the first that is off
    (``gram_draws`` and ``split_rows`` only mean something with the closed-form mean)."""
    if parts.shape != (len(gaussians), 2):
        raise ValueError(f"parts must be (classes, 2) = ({len(gaussians)}, 2), not {tuple(parts.shape)}")
    if draws < 1:
        raise ValueError(f"draws must be at least 1, not {draws}")
    if gram_draws is not None and (gram_draws < 1 or not exact_mean):
        raise ValueError(f"gram_draws must be at least 1 and needs exact_mean, not {gram_draws}")
    if split_rows and not exact_mean:
        raise ValueError("split_rows needs exact_mean")


def _chunks(read: int, number: int) -> list[tuple[int, int, bool]]:
    """(start, count, first_only) of a class's ``number`` draws: the ``read`` draws the sums read,
    whole, then the rest for x alone (its first token): chunks of at most CHUNK."""
    chunks = [(a, min(CHUNK, read - a), False) for a in range(0, read, CHUNK)]
    chunks += [(a, min(CHUNK, number - a), True) for a in range(read, number, CHUNK)]
    return chunks


@dataclass(frozen=True)
class _Drawer:
    """What every class's draws share in ``expected_sums``: the Gaussians on the sums' device, R (and
    its input ``width``, the layout cells ``head_input`` reads), the one CPU ``generator`` (the classes
    drawn in order from it), the sink their φ go to, and E[φ] of each class (None: uncentred)."""

    gaussians: ClassGaussians
    projection: Tensor
    width: int
    layout_cells: int
    generator: torch.Generator
    sink: _Shared | _Split
    exact: Tensor | None

    def draw_class(self, c: int, read: int, number: int, mean: Tensor) -> Tensor:
        """Class ``c``'s ``number`` draws, the first ``read`` of them into the sink: the running mean
        of its x into ``mean`` (its row of the means, in place) and the scatter of x returned."""
        d = self.gaussians.tokens[1]
        x_scatter = torch.zeros(d, d, dtype=STAT_DTYPE, device=self.projection.device)
        for start, count, first_only in _chunks(read, number):
            samples = self.gaussians.draw(c, count, self.generator, first_only=first_only).to(STAT_DTYPE)
            x = covariance_input(samples)
            chunk_mean = x.mean(0)
            centred = x - chunk_mean
            # the chunks' centred scatters joined (Chan et al.): positive semi-definite by construction
            step = chunk_mean - mean
            x_scatter += centred.T @ centred + torch.outer(step, step) * start * len(x) / (start + len(x))
            mean += step * len(x) / (start + len(x))
            if not first_only:
                phi = expand(head_input(samples[: read - start], self.width, self.layout_cells), self.projection)
                self.sink.add(start, phi if self.exact is None else phi.sub_(self.exact[c]))
        return x_scatter


def _add_exact_means(q: Tensor, grams: Tensor, exact: Tensor, parts: Tensor) -> None:
    """With the closed-form mean m = E[φ]: Q_part = n_part · m, and n_part m mᵀ added to each Gram
    (the draws gave the centred part), in place."""
    for part in range(2):
        weights = parts[:, part].to(dtype=STAT_DTYPE, device=q.device)
        q[part] = (exact * weights[:, None]).T
        grams[part].addmm_(exact.T * weights, exact)  # Σ_c n_part m mᵀ, one product for every class


class _Shared:
    """Every read row of a class in both Grams: the class's Σ φφᵀ (of φ − m, ``centred``), then added
    to each part at n_part / read; uncentred, its Σ φ too, into Q."""

    def __init__(self, grams: Tensor, q: Tensor, parts: Tensor, *, centred: bool) -> None:
        self.grams, self.q, self.parts, self.centred = grams, q, parts, centred
        self.second = torch.empty_like(grams[0])  # one class's, reused
        self.first = grams.new_zeros(grams.shape[-1])
        self.c = self.read = 0

    def start(self, c: int, read: int) -> None:
        self.c, self.read = c, read
        self.first.zero_()
        self.second.zero_()

    def add(self, start: int, phi: Tensor) -> None:
        if self.centred:
            self.second.addmm_(phi.T, phi)
        else:
            self.first += phi.sum(0)
            self.second += phi.T @ phi

    def end(self) -> None:
        for part in range(2):
            n = int(self.parts[self.c, part])
            if self.centred:  # in place: an M x M temporary a class costs as much as a few draws' products
                self.grams[part].add_(self.second, alpha=n / self.read)
            else:
                self.q[part][:, self.c] = n * self.first / self.read
                self.grams[part] += n * self.second / self.read

    def flush(self) -> None:
        pass


class _Split:
    """A class's read rows split between the fit and held-out Grams (``_part_rows``), each row weighted
    by √(n_part / the part's rows) into a buffer a part that many classes fill before one product, so
    no class costs an M x M pass of its own."""

    ROWS = 2048  # a buffer's rows: M x 2048 float64 (49 MB at M 3,000)

    def __init__(self, grams: Tensor, parts: Tensor) -> None:
        self.grams, self.parts = grams, parts
        self.buffers = [grams.new_empty(self.ROWS, grams.shape[-1]) for _ in range(2)]
        self.filled = [0, 0]
        self.c, self.ranges = 0, ((0, 0), (0, 0))

    def start(self, c: int, read: int) -> None:
        self.c, self.ranges = c, _part_rows(read, int(self.parts[c, 0]), int(self.parts[c, 1]))

    def add(self, start: int, phi: Tensor) -> None:
        for part, (low, high) in enumerate(self.ranges):  # this chunk's rows of the part
            rows = phi[max(low - start, 0) : max(high - start, 0)]
            weight = math.sqrt(int(self.parts[self.c, part]) / max(high - low, 1))
            while len(rows):
                take = min(len(rows), self.ROWS - self.filled[part])
                torch.mul(rows[:take], weight, out=self.buffers[part][self.filled[part] : self.filled[part] + take])
                self.filled[part] += take
                rows = rows[take:]
                if self.filled[part] == self.ROWS:
                    self._flush(part)

    def end(self) -> None:
        pass

    def flush(self) -> None:
        for part in range(2):
            self._flush(part)

    def _flush(self, part: int) -> None:
        rows = self.buffers[part][: self.filled[part]]
        if len(rows):
            self.grams[part].addmm_(rows.T, rows)
        self.filled[part] = 0


def _part_rows(read: int, fit: int, held: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """A class's ``read`` rows for the fit and held-out Grams ((low, high) each), in proportion to its
    ``fit`` and ``held`` images; a part without images reads none, and a single row serves both."""
    if held == 0 or fit == 0:
        return ((0, read), (read, read)) if held == 0 else ((0, 0), (0, read))
    if read < 2:
        return (0, read), (0, read)
    cut = min(read - 1, max(1, round(read * fit / (fit + held))))
    return (0, cut), (cut, read)


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
