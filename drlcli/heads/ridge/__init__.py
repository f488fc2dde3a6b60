"""The ridge head: RanPAC's analytic head (McDonnell et al., "RanPAC: Random Projections and
Pre-trained Models for Continual Learning", NeurIPS 2023), extended; nothing is trained.

The frozen PTM's feature h (d) is expanded by a fixed random matrix R (d, M) and a ReLU,
φ(h) = ReLU(h R) (RanPAC Eq. 3; R ~ N(0, 1), seeded, stored in stage 1's weights so it never
depends on RNG reproducibility). A class's score is the ridge regression output φ(h) W, with

    W = (G + λI)⁻¹ Q,    G = Σ φ φᵀ (M, M),    Q = Σ φ yᵀ (M, C)        (RanPAC Eq. 4-5)

over every image seen so far (y one-hot). G and Q are sums, so stages accumulate them exactly:
no image or per-image feature is kept, and the result equals the ridge on all data at once.

λ is chosen from statistics alone. Each stage's images are split per class, 80/20 (seeded); the
two parts are accumulated apart (fit: G_f, Q_f; validation: G_v, Q_v, n_v). For each λ of the
log grid, W_λ = (G_f + λI)⁻¹ Q_f and its validation squared error is

    ‖Φ_v W_λ − Y_v‖² = tr(W_λᵀ G_v W_λ) − 2 tr(W_λᵀ Q_v) + n_v        (one-hot rows: ‖Y_v‖² = n_v)

The best λ then solves on the sum: W = (G_f + G_v + λI)⁻¹ (Q_f + Q_v). Two things keep a stage's
work from growing with the classes seen: ``lambda_classes`` k takes each λ's error over k of them,
drawn at random and scaled to all (``statistics.sampled``), and a stage with fewer images than earlier
classes, at the λ of the stage before, moves their columns of W by its images, W_prev − (G + λI)⁻¹ Φᵀ
(Φ W_prev), instead of solving them again (``statistics.solve``; exact up to round-off).

Storage: ``statistics.safetensors`` of each stage holds Q_f, Q_v for its own classes only (an
old class's columns of Q never change: its y is 0 in later stages); ``weights.safetensors`` of
stage 1 holds R (d, M). The newest stage's ``totals.safetensors`` carries what is summed over
every stage so far and what is solved from it: G_f and G_v as packed upper triangles (M(M+1)/2
fp32 each: 18 MB at M 3000), the image counts, and W for every class seen (M, C); the next stage
adds its images to them and supersedes the file, so that a stage reads and writes the same bytes
whatever T is and the run keeps one copy. (Runs of earlier releases hold each stage's increments
of G and each stage's W; they are summed once, at their next stage.) RanPAC's first-stage adaptation of the
PTM (its phase 1) is the ``adapter`` feature network's (recipe ``ranpac-published``): the head reads the adapted PTM's f_0.

Class covariances (``ridge.covariance_weight`` w > 0; drl's default, not RanPAC's): a second,
FeCAM-style score on x = f_0 / ‖f_0‖, the negative Mahalanobis distance to each class's mean,

    m_c(x) = −(x − μ_c)ᵀ P_c (x − μ_c),    P_c = shrink_a((1 − b) S_c + b S)⁻¹,
    shrink_a(S) = (1 − a) S + a (tr S / d) I,

S_c the class's covariance, S the within-class covariance pooled over every class seen (a
``covariance_shrink``, b ``covariance_blend``). The two scores are put on one scale per image by
standardising each over the classes (z(s) = (s − mean) / std) and added: z(ridge) + w z(m). Each
stage stores its classes' μ_c and S_c (weights file, one row per class) and its summed
within-class scatter with its image and class counts (statistics file); the newest stage's
weights hold the pooled S and (w, a, b). The precisions are computed when the head is built, so
every class's P_c uses the newest S (``docs/research/class-covariances.md`` at b4fbb16: freezing them at their own stage lost
the gain on Caltech-101).

The PTM's layout (``ridge.layout_grid`` g > 0; drl's default g 2, not RanPAC's): the ridge's input
is h = [f_0, l_1, ..., l_g²], l_k the mean of the PTM's final patch tokens over cell k of a g x g
grid of the image (``backbone.ptm_layout``, from the same PTM pass: its last block runs for every
token instead of the class token alone). The class token is trained to ignore where things are;
the cells keep it, which separates classes such as Caltech-101's Faces and Faces_easy (the same
faces, framed wide or tight). ``ridge.layout_scale`` s weighs the cells against f_0; it is folded
into R (the cells' rows times s), so scoring costs nothing for it. g is stored in stage 1's weights
beside R. The class covariances stay on f_0.

A carried run (``carry/``; the default's schedule) retrains the network the head reads at
every stage, so the earlier classes' stored sums no longer describe their features: its fit reads
them from class Gaussians moved with the network (``EarlierStages.carried``), solves every column
of W again, and keeps every class's covariance rows, as drawn, in the newest stage's totals, with
the sums it fitted (Q of every class, the Grams, the scatter): a stage that did not train the
network (a paused switched run) reads those instead of drawing them again.

The folder: ``options.py`` its run-config section (``ridge``; ``ranpac`` in runs of earlier releases), ``statistics.py`` the
sums and the ridge solve, ``covariance.py`` the class covariances, ``head.py`` the scoring module,
``fit.py`` one stage's fit and the re-solve of a restored class, ``carry/`` the carried classes. This module holds the head's
facts for the registry (no torch): its tensor names, its per-class tensors, what it reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import UsageError
from ..base import AnalyticHead, Head, PerClass
from .options import RidgeConfig

if TYPE_CHECKING:
    from ...config import RunConfig

SECTION = "ridge"  # the options' section in run.yaml (``ranpac`` in runs of earlier releases)
PREFIX = "ranpac."  # the head's stage tensors, as every release has named them
PROJECTION = f"{PREFIX}projection"  # (rows, M) R, in stage 1's weights
WEIGHT = f"{PREFIX}weight"  # (M, C) W for every class seen, in each stage's weights (the newest scores)
LAYOUT = f"{PREFIX}layout"  # () int64 in stage 1's weights: g, the PTM layout grid of the head's input
COV_MEAN = f"{PREFIX}cov_mean"  # (n, d) per class of the stage
COV_COVARIANCE = f"{PREFIX}cov_covariance"  # (n, d, d) per class of the stage (covariance_rank 0)
COV_FACTOR = f"{PREFIX}cov_factor"  # (n, d, r) per class of the stage: Y_c Y_cᵀ ≈ S_c (covariance_rank r)
COV_TRACE = f"{PREFIX}cov_trace"  # (n,) per class of the stage: tr S_c (covariance_rank r)
COV_SHARED = f"{PREFIX}cov_shared"  # (d, d) pooled within-class covariance, newest stage
COV_PARAMS = f"{PREFIX}cov_params"  # (3,) w, a, b, newest stage
COV_SCATTER, COV_COUNTS = "cov_scatter", "cov_counts"  # statistics: (d, d) summed scatter, (2,) images, classes
LAMBDA = "lambda"  # statistics: (1,) the λ the newest stage chose, where the next stage's search starts
# a carried run (``carry/``), in the newest stage's totals: every class's covariance tensors as it
# drew them, every class's Gaussian (``ClassGaussians.to_tensors`` under CARRY; the linear parts'
# products are per group, the rest per class) and its fit and held-out image counts (C, 2)
CARRY_COV = {name: f"{name}_carried" for name in (COV_MEAN, COV_COVARIANCE, COV_FACTOR, COV_TRACE)}
# and Q of every class as the stage summed it (the earlier classes' drawn, its own), which with the
# Grams and scatter summed so far a paused next stage reads instead of drawing them again
CARRY_Q = {name: f"{name}_carried" for name in ("q_fit", "q_val")}
CARRY = f"{PREFIX}carry_"
CARRY_PER_CLASS = tuple(f"{CARRY}{name}" for name in ("mean", "factor", "rank", "spread", "count", "group", "parts"))
CARRY_LINEAR = f"{CARRY}linear"
# each class's images (its Gaussian's count, its fit and held-out counts): at most what its stage recorded
CARRY_IMAGES = (f"{CARRY}count", f"{CARRY}parts")
# the newest stage's totals: W and what the covariances share, the Grams and scatters summed so far
RUNNING = (
    WEIGHT, COV_SHARED, COV_PARAMS, "gram_fit", "gram_val", "counts", LAMBDA, COV_SCATTER, COV_COUNTS,
    *CARRY_COV.values(), *CARRY_Q.values(), *CARRY_PER_CLASS, CARRY_LINEAR,
)  # fmt: skip
PER_CLASS = (
    PerClass("weights", COV_MEAN, 0),
    PerClass("weights", COV_COVARIANCE, 0),
    PerClass("weights", COV_FACTOR, 0),
    PerClass("weights", COV_TRACE, 0),
    PerClass("weights", WEIGHT, 1, seen=True),  # W (M, C) of every stage, in runs of earlier releases
    PerClass("totals", WEIGHT, 1, seen=True),  # W (M, C), solved again by each stage, in the newest's totals
    PerClass("statistics", "q_fit", 1),  # Q (M, n) of the stage's own classes (statistics.Statistics)
    PerClass("statistics", "q_val", 1),
    *(
        PerClass("totals", name, 0, seen=True, carried=True, images=name in CARRY_IMAGES)
        for name in (*CARRY_COV.values(), *CARRY_PER_CLASS)
    ),
    *(PerClass("totals", name, 1, seen=True, carried=True) for name in CARRY_Q.values()),
)

# the dtype each stage tensor is written in (``Head.dtypes``): the carried Gaussians are drawn from in
# float64 and counted in int64, as ``carry.ClassGaussians`` makes them; the rest are read as floats
DTYPES = {
    **{name: "float" for name in (PROJECTION, WEIGHT, COV_MEAN, COV_COVARIANCE, COV_FACTOR, COV_TRACE)},
    **{name: "float" for name in (COV_SHARED, COV_PARAMS, COV_SCATTER, COV_COUNTS, LAMBDA, "gram_fit", "gram_val")},
    **{name: "float" for name in ("counts", "q_fit", "q_val", *CARRY_COV.values(), *CARRY_Q.values())},
    LAYOUT: "int64",
    **{f"{CARRY}{name}": "float64" for name in ("mean", "factor", "spread", "linear")},
    **{f"{CARRY}{name}": "int64" for name in ("rank", "count", "group", "parts")},
}


def _load() -> AnalyticHead:
    from . import fit

    return fit  # fit_stage, from_stages, from_state


def _stages_read(config: RunConfig) -> int:
    return config.ridge.subspaces - 1


def _layout_grid(config: RunConfig) -> int:
    return config.ridge.layout_grid


def _rules(config: RunConfig, method: Any) -> None:
    cfg = config.ridge
    if cfg.lambda_min_exp > cfg.lambda_max_exp:
        raise UsageError("ridge.lambda_min_exp must be <= ridge.lambda_max_exp")
    if cfg.carry_gram_draws is not None and cfg.carry_mean != "exact":
        raise UsageError(
            "ridge.carry_gram_draws needs the closed-form E[φ]: set ridge.carry_mean exact, "
            "or ridge.carry_gram_draws null for the drawn carry"
        )
    if cfg.carry_grams == "split" and cfg.carry_mean != "exact":
        raise UsageError(
            "ridge.carry_grams split needs the closed-form E[φ]: set ridge.carry_mean exact, "
            "or ridge.carry_grams shared for the drawn carry"
        )
    if config.score.head == "ridge" and not method.offset:
        raise UsageError(f"score.head ridge needs a PTM subspace, which method {config.method} has not: use prototypes")
    if cfg.subspaces == 2 and not (method.trains and method.offset and config.score.head == "ridge"):
        raise UsageError("ridge.subspaces 2 reads stage 1's subspace: only for method drl with score.head ridge")


HEAD = Head(
    name="ridge",
    section=SECTION,
    options=RidgeConfig,
    load=_load,
    per_class=PER_CLASS,
    running=RUNNING,
    stages_read=_stages_read,
    layout_grid=_layout_grid,
    rules=_rules,
    dtypes=DTYPES,
)
