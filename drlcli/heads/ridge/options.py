"""The ridge head's section of a run config (named ``ranpac`` in run.yaml: RanPAC's head, extended)."""

from __future__ import annotations

from dataclasses import dataclass

from ...options import Range, option

MAX_LAYOUT_GRID = 8  # layout_grid's bound (and that of a g a run or an export stores)


@dataclass(frozen=True)
class RidgeConfig:
    """Random projection + ReLU + ridge regression from accumulated statistics (``heads/ridge``)."""

    # M, width of the random projection; None: min(3000, 16 d) (3000 for DeiT-Tiny)
    # M: the head holds (M, M) float64 Grams and factorises them: 16,384 is 2 GiB each (65,536 passed
    # init and failed every learn-stage allocating 34 GB); RanPAC's own M is 10,000
    proj_dim: int | None = option(None, within=Range(1, 16_384))
    # of each stage's images, held out in the statistics to choose λ
    val_fraction: float = option(0.2, within=Range(0, 1, low_open=True, high_open=True))
    lambda_min_exp: int = option(-8, within=Range(-30, 30))  # λ grid: 10^min .. 10^max, one per decade (RanPAC's)
    lambda_max_exp: int = option(8, within=Range(-30, 30))
    # grid: every λ of the grid at every stage (RanPAC's); local: from stage 2, start at the λ the stage
    # before chose and step through the grid while the validation error falls (a few Cholesky
    # factorisations instead of one eigendecomposition: the same λ wherever the error has one minimum)
    lambda_search: str = option("grid", choices=("grid", "local"))
    # λ's validation error over at most this many of the classes seen, drawn at random each stage and
    # scaled to all of them (the search's work stops growing with the classes); 0: every class
    lambda_classes: int = option(0, within=Range(0, 1_000_000))
    # leading subspaces the head reads: 1: f_0 (RanPAC's); 2: [f_0, f_1] (drl: + stage 1's)
    subspaces: int = option(1, within=Range(1, 2))
    # class covariances: w of z(ridge) + w z(-Mahalanobis to class means); 0: RanPAC's ridge alone
    covariance_weight: float = option(0.0, within=Range(0, 100))
    covariance_shrink: float = option(0.3, within=Range(0, 1))  # a: S <- (1 - a) S + a (tr S / d) I
    covariance_blend: float = option(0.8, within=Range(0, 1))  # b: S_c <- (1 - b) S_c + b S_pooled
    # r: each class's covariance kept as its r leading eigenpairs (stored (d, r), scored by Woodbury:
    # C·d·(r + 2) per image instead of C·d²); 0: whole (d, d) per class, as runs before it
    covariance_rank: int = option(0, within=Range(0, 4096))
    # the PTM's layout in the head's input (drl's default, not RanPAC's): g > 0 appends the last
    # block's patch tokens averaged over a g x g grid of the image (backbone.ptm_layout), fixed at stage 1
    layout_grid: int = option(0, within=Range(0, MAX_LAYOUT_GRID))
    # the layout's weight against f_0 in the input (folded into R's rows)
    layout_scale: float = option(1.0, within=Range(0, 100, low_open=True))
    # a carried run (schedule.stages all): each class kept as a Gaussian of the head's
    # tokens with this many leading directions, moved by per-token ridge maps of this λ (absolute:
    # tuned on DeiT-Tiny's sketch validation split), the head's sums rebuilt from this many draws per image
    carry_rank: int = option(16, within=Range(1, 4096))
    carry_lambda: float = option(1000.0, within=Range(0, 1e12, low_open=True))
    carry_draws: int = option(100, within=Range(1, 10_000))
    # what the rebuilt sums read of the draws: "drawn", E[φ] (Q) and the Grams from every draw; "exact",
    # E[φ] in closed form (h R is Gaussian) and the Grams from carry_gram_draws draws over all the earlier
    # classes (each class's share by its images; None: every draw), so that the M x M products, most
    # of a carried stage's fit, stop growing with the images seen
    carry_mean: str = option("drawn", choices=("drawn", "exact"))
    carry_gram_draws: int | None = option(None, within=Range(1, 1_000_000_000))
    # with carry_mean exact, how the Grams' rows serve the fit and held-out parts: "shared", every row
    # in both (twentieth round); "split", each class's rows divided between them in proportion to its
    # images there, so the held-out part is held out (λ is chosen on rows the fit did not read) and
    # many classes' rows go into one product, no M x M pass a class (twenty-first round)
    carry_grams: str = option("shared", choices=("shared", "split"))

    def resolved_proj_dim(self, width: int) -> int:
        return self.proj_dim if self.proj_dim is not None else min(3000, 16 * width)
