"""Open-set answers: "unknown" for an image unlike every class the model has learned.

Two rules, both from class-level statistics of the subspace-0 feature f_0 (the PTM's; stage 1's for
``ease``), chosen by ``open_set.score`` (``docs/research/unknown-answer.md`` at b4fbb16):

- ``rmd`` (the default): the relative Mahalanobis distance (Ren et al. 2021) on x, the unit vector
  along [f_0/‖f_0‖, w t/‖t‖] (``rmd_input``), t the class token after an earlier PTM block, through
  the final norm (``open_set.probe_depth``: block 7 of DeiT's 12; w ``open_set.probe_weight`` 2),
  taken from the same single pass. The earlier block knows what the image is made of before the
  last blocks turn it into a class: with it, over three class orders, test AUROC rose from 0.906
  to 0.924 (Caltech-101) and 0.753 to 0.771 (Caltech-101-Sketch). Without a probe block (``ease``,
  ``probe_depth: null``, runs learned before it), x = f_0/‖f_0‖.
  With μ_c the mean of class c's x, Σ_w their pooled within-class covariance and (μ_0, Σ_t) the
  Gaussian of all known images, each covariance shrunk by ``SHRINK`` towards its mean variance
  (``shrunk``),

      rmd_c(x) = (x - μ_0)ᵀ Σ_t⁻¹ (x - μ_0) - (x - μ_c)ᵀ Σ_w⁻¹ (x - μ_c),

  high when x is nearer class c than the bulk of known images. It separated unknown images better
  than the cosine on both datasets and all three class orders of the validation splits (Sketch
  +0.047 AUROC on average). Each stage stores its classes' means and image counts and its summed
  within-class scatter (``Moments``); the model sums them.
- ``cosine``: the cosine of f_0 to class c's prototype in subspace 0 (the earlier default).
  A run whose stages lack the ``rmd`` statistics (learned before they existed) answers by it.

Class c claims an image when its score reaches c's bias b_c; an image no class claims is unknown:

    known(x) = max_c [score_c(x) - b_c],     unknown  <=>  known(x) < 0

with b_c the mean of the learned classes' stage thresholds (``open_set_bias``): one threshold for
the model, set from every stage's own calibration (per-stage thresholds separated less well).

Calibration, per stage at commit time, from its own training images only: a share of each class's
images (``open_set.holdout``, at least one) is held out, the stage's statistics are recomputed
without them (the cosine's prototypes; for ``rmd`` the earlier stages' moments joined with the
kept images'), and the stage's threshold t is the ``open_set.rejection`` quantile of the held-out
images' best score; each class of the stage stores t (``unknown_bias``, ``unknown_rmd_bias``).
No image or per-image feature is kept: only these numbers and the moments go into the stage.

A carried run (``Schedule.carries``) moves the network at every stage, so the earlier
classes' means and the scatter would describe x of a network that no longer exists. Each of its
stages moves them with the network as the head's class Gaussians are moved: one ridge map of x
(``linalg.ridge_map``) from the stage's own images before its training to after it, applied to every
earlier class's mean and to the scatter (``Moments.moved``); the newest stage's totals hold every
class's mean as moved (``RMD_MEAN_CARRIED``), which the run reads in place of the means as taken.

- cosine: the best score over the stage's classes, a plain quantile. A cosine threshold holds for
  the life of the run (prototypes never change).
- rmd: the best score over every class learned so far, as the model will score them, and a
  class-balanced quantile (``balanced_quantile``: each class weighs the same, as on a balanced
  test). An rmd threshold is set against the statistics of its commit, which later classes move.
  Over three class orders the share of known test images rejected for a 5 % target was 5.1 %
  (Caltech-101) and 4.9 % (Caltech-101-Sketch); scoring the stage's classes alone with a plain
  quantile, as before, gave 5.3 % and 2.1 % on f_0 (``docs/research/unknown-answer.md`` at b4fbb16, calibration).

The folder: ``rmd.py`` the scores and their statistics (``Moments``, ``RmdKnown``, ``CosineKnown``),
``calibrate.py`` the thresholds a stage sets at commit time, ``report.py`` the open-set metrics of
``drl eval --unknown-data``. This module names the tensors (light: no torch), so the run directory
and ``forget`` can ask for them without the maths.
"""

from __future__ import annotations

from ..base import PerClass

BIAS = "unknown_bias"  # the per-class tensor name, in a stage's weights and among restore.py's tensors


# the rmd rule's tensors, under the same names in a stage's weights (its classes, its scatter) and
# among restore.py's tensors (every class; the scatters and their counts summed over the stages)
RMD_MEAN = "unknown_mean"  # (n, w) per class: the mean of x (``rmd_input`` normalised; w = d or 2d)


RMD_COUNT = "unknown_count"  # (n,) per class: its images


RMD_BIAS = "unknown_rmd_bias"  # (n,) per class: its stage's rmd threshold


RMD_SCATTER = "unknown_scatter"  # (w, w) the summed within-class scatter of x


RMD_SCATTER_COUNTS = "unknown_scatter_counts"  # (2,) the images and classes that scatter sums over


RMD_ROWS = (RMD_MEAN, RMD_COUNT, RMD_BIAS)  # one row per class (``forget`` takes a class's out)


RMD_TENSORS = (*RMD_ROWS, RMD_SCATTER, RMD_SCATTER_COUNTS)


RUNNING = (RMD_SCATTER, RMD_SCATTER_COUNTS)  # summed over every stage: the newest stage's totals hold them


RMD_MEAN_CARRIED = f"{RMD_MEAN}_carried"  # (C, w) a carried run's newest totals: every class's mean, moved


RULES = ("rmd", "cosine")

# one row per class of the stage: ``drl forget`` takes a class's rows out
PER_CLASS = (
    *(PerClass("weights", name, 0) for name in (BIAS, *RMD_ROWS)),
    PerClass("totals", RMD_MEAN_CARRIED, 0, seen=True, carried=True),
)
