"""The ridge head as a module (see the folder's docstring): the random projection R, the head's
input (f_0, stage 1's subspace if read, the PTM's layout rows), and ``RidgeHead``, which scores
ReLU(h R) W, plus the class covariances' term."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import (
    CARRY_COV,
    COV_COVARIANCE,
    COV_FACTOR,
    COV_MEAN,
    COV_PARAMS,
    COV_SHARED,
    COV_TRACE,
    LAYOUT,
    PROJECTION,
    WEIGHT,
)
from .covariance import LowRankPrecisions, covariance_input, lowrank_distance, precisions, standardise
from .options import MAX_LAYOUT_GRID


def random_projection(
    width: int, proj_dim: int, *, seed: int, layout_rows: int = 0, layout_scale: float = 1.0
) -> Tensor:
    """R (width, M), N(0, 1) entries (RanPAC's W_rand), from its own generator; its last
    ``layout_rows`` rows (those the PTM layout meets) times ``layout_scale``: ReLU([f_0, s·l] R)
    with l the layout is ReLU([f_0, l] R'), so the scale lives in R and costs nothing to score."""
    projection = torch.randn(width, proj_dim, generator=torch.Generator().manual_seed(seed))
    if layout_rows:
        projection[width - layout_rows :] *= layout_scale
    return projection


def head_input(features: Tensor, input_dim: int, layout_cells: int = 0) -> Tensor:
    """The head's input h, (B, input_dim): the leading subspaces of (B, S, d) features (f_0, RanPAC's;
    ``ranpac.subspaces`` 2: [f_0, f_1]) and, with ``layout_cells`` > 0, the last that many rows
    (the PTM's layout, ``backbone.ptm_layout``), concatenated."""
    subspaces = input_dim // features.shape[-1] - layout_cells
    rows = features[:, :subspaces]
    if layout_cells:
        rows = torch.cat([rows, features[:, features.shape[1] - layout_cells :]], dim=1)
    return rows.flatten(1)


def check_layout(value: Tensor | None) -> int:
    """g from a stored layout tensor (None: 0, no layout); ``ValueError`` for anything but a small
    non-negative integer."""
    if value is None:
        return 0
    if value.numel() != 1 or value.dtype != torch.int64 or not 0 <= int(value) <= MAX_LAYOUT_GRID:
        raise ValueError(
            f"{LAYOUT} must be one int64 in [0, {MAX_LAYOUT_GRID}], got {value.dtype} of shape {tuple(value.shape)}"
        )
    return int(value)


def expand(features: Tensor, projection: Tensor) -> Tensor:
    """φ = ReLU(h R): (N, d) -> (N, M), in the projection's dtype."""
    return F.relu(features.to(projection) @ projection)


class RidgeHead(nn.Module):
    """Scores from the PTM subspace, (B, S, d) -> (B, C): ReLU(f_0 R) W, or with class covariances
    z(ReLU(f_0 R) W) + w z(m(x)) (module docstring)."""

    def __init__(
        self,
        projection: Tensor,
        weight: Tensor,
        cov_mean: Tensor | None = None,
        cov_precision: Tensor | None = None,
        cov_weight: Tensor | None = None,
        layout: int = 0,
        cov_lowrank: LowRankPrecisions | None = None,
    ):
        super().__init__()
        _check_weight(projection, weight)
        self.layout_grid = layout  # g: the input ends with the PTM's g² layout rows (0: none)
        self.register_buffer("layout", torch.tensor(layout) if layout else None)
        self.register_buffer("projection", projection.float().contiguous())  # (d, M)
        self.register_buffer("weight", weight.float().contiguous())  # (M, C)
        lowrank = _check_lowrank(cov_lowrank, weight.shape[1]) if cov_lowrank is not None else None
        for name in LOWRANK:  # the class covariances in low-rank form (covariance.LowRankPrecisions)
            value = None if lowrank is None else getattr(lowrank, name[4:])
            self.register_buffer(name, value if value is None or name == "cov_factor" else value.float().contiguous())
        # F_c in float32 for scoring, made once here: not in the state (the float16 factor and s are)
        full = None if lowrank is None else lowrank.full_factor().contiguous()
        self.register_buffer("cov_factor_full", full, persistent=False)
        if lowrank is not None:
            if cov_mean is not None or cov_precision is not None or cov_weight is None:
                raise ValueError(
                    "a low-rank class-covariance head takes cov_weight and no dense cov_mean or cov_precision"
                )
            parts = (None, None, cov_weight.float().reshape(()))
        else:
            parts = _dense_parts(cov_mean, cov_precision, cov_weight, weight.shape[1])
        self.register_buffer("cov_mean", parts[0])  # (C, d); None: plain ridge (RanPAC's)
        self.register_buffer("cov_precision", parts[1])  # (C, d, d)
        self.register_buffer("cov_weight", parts[2])  # () w

    def forward(self, features: Tensor) -> Tensor:
        # the head lives on the model's device and scores in fp32 (``IncrementalModel.scores``): no
        # per-batch copy, and no `.to(features)` that a traced graph would record with its device
        cells = self.layout_grid**2
        phi = F.relu(head_input(features, self.projection.shape[0], cells) @ self.projection)  # (B, M)
        scores = phi @ self.weight
        if self.cov_weight is None:
            return scores
        x = covariance_input(features)
        if self.cov_rotation is not None:
            distance = lowrank_distance(
                x,
                self.cov_rotation,
                self.cov_scale,
                self.cov_center,
                self.cov_const,
                self.cov_factor_full,
                self.cov_offset,
            )
        else:
            diff = x[:, None, :] - self.cov_mean  # (B, C, d)
            distance = (torch.einsum("bcd,cde->bce", diff, self.cov_precision) * diff).sum(-1)  # (B, C)
        return standardise(scores) - self.cov_weight * standardise(distance)

    @property
    def num_classes(self) -> int:
        """The classes it scores: W's columns."""
        return self.weight.shape[1]

    @property
    def covariance_width(self) -> int | None:
        if self.cov_rotation is not None:
            return self.cov_rotation.shape[0]
        return None if self.cov_mean is None else self.cov_mean.shape[-1]

    def check_width(self, width: int) -> None:
        """ValueError unless the head reads one or two subspaces of the network's ``width`` (and its
        layout rows) and its class covariances have that width."""
        cells = self.layout_grid**2
        rows = self.projection.shape[0] if self.projection.dim() == 2 else -1
        allowed = [width * (subspaces + cells) for subspaces in (1, 2)]
        if rows not in allowed:
            raise ValueError(f"the head's projection has {rows} input rows, not {' or '.join(map(str, allowed))}")
        if self.covariance_width not in (None, width):
            raise ValueError(f"the class covariances have width {self.covariance_width}, not the network's {width}")

    def stages_read(self, width: int) -> int:
        """How many stage subspaces after f_0 the head reads (0: f_0 alone, RanPAC's)."""
        return self.projection.shape[0] // width - self.layout_grid**2 - 1

    @classmethod
    def from_state(cls, state: dict[str, Tensor]) -> RidgeHead:
        lowrank = None
        if any(name in state for name in LOWRANK):
            required = LOWRANK[:-1]  # exports of releases before hold a float32 F_c and no scale
            if not all(name in state for name in required):
                raise ValueError(f"the low-rank class covariances need {', '.join(required)}")
            lowrank = LowRankPrecisions(*(state.get(name, torch.tensor(1.0)) for name in LOWRANK))
        return cls(
            state["projection"],
            state["weight"],
            state.get("cov_mean"),
            state.get("cov_precision"),
            state.get("cov_weight"),
            layout=check_layout(state.get("layout")),
            cov_lowrank=lowrank,
        )

    @classmethod
    def from_stages(cls, stage_tensors: list[dict[str, Tensor]], *, scoring: bool = True) -> RidgeHead:
        """R from stage 1's weights, W (and, with class covariances, S and w, a, b) from the newest
        stage's, μ_c and S_c from each class's own stage. ``scoring`` False: without the class
        covariances (the ridge alone), for a learn-stage that fits and scores with a new head."""
        first = stage_tensors[0]
        layout = check_layout(first.get(LAYOUT))
        if not scoring:
            return cls(first[PROJECTION], stage_tensors[-1][WEIGHT], layout=layout)
        return cls.assemble(first[PROJECTION], stage_tensors[-1], stage_tensors, layout=layout)

    @classmethod
    def assemble(
        cls, projection: Tensor, newest: dict[str, Tensor], stages: list[dict[str, Tensor]], *, layout: int = 0
    ) -> RidgeHead:
        """The head from R, the newest stage's tensors and every stage's (for μ_c and S_c); ``layout``
        g as stage 1 stored it."""
        weight = newest[WEIGHT]
        if COV_PARAMS not in newest:
            return cls(projection, weight, layout=layout)
        cov_weight, shrink, blend = _cov_params(newest[COV_PARAMS])
        if COV_SHARED not in newest:
            raise ValueError("the newest stage lacks the pooled covariance")
        shared = newest[COV_SHARED]
        if CARRY_COV[COV_MEAN] in newest:  # a carried run: every class's rows, as its newest stage drew them
            stages = [{name: newest[carried] for name, carried in CARRY_COV.items() if carried in newest}]
        if COV_FACTOR in stages[-1]:  # the low-rank form (ranpac.covariance_rank > 0)
            parts = (joined_rows(stages, name) for name in (COV_MEAN, COV_FACTOR, COV_TRACE))
            lowrank = LowRankPrecisions.of(*parts, shared, shrink=shrink, blend=blend)
            return cls(projection, weight, cov_weight=torch.tensor(cov_weight), layout=layout, cov_lowrank=lowrank)
        covariances = joined_rows(stages, COV_COVARIANCE)
        if covariances.dim() != 3 or tuple(shared.shape) != tuple(covariances.shape[1:]):
            raise ValueError(f"{COV_SHARED} has shape {tuple(shared.shape)}, not one class covariance's")
        return cls(
            projection,
            weight,
            joined_rows(stages, COV_MEAN),
            precisions(covariances, shared, shrink=shrink, blend=blend),
            torch.tensor(cov_weight),
            layout=layout,
        )


def _check_weight(projection: Tensor, weight: Tensor) -> None:
    """R (rows, M) and W (M, C), floating; ValueError naming the tensor that is not."""
    if projection.dim() != 2 or not projection.is_floating_point():
        raise ValueError(f"{PROJECTION} is {projection.dtype} of shape {tuple(projection.shape)}, not (rows, M) floats")
    if weight.dim() != 2 or weight.shape[0] != projection.shape[1] or not weight.is_floating_point():
        size = projection.shape[1]
        raise ValueError(f"{WEIGHT} is {weight.dtype} of shape {tuple(weight.shape)}, not ({size}, classes) floats")


def check_stages(stage_tensors: list[dict[str, Tensor]]) -> None:
    """``AnalyticHead.check_stages``: R in stage 1's weights and W, in every stage that holds one, of
    R's M rows (a run without the ridge head holds neither); ValueError naming what is off."""
    weights = [tensors[WEIGHT] for tensors in stage_tensors if WEIGHT in tensors]
    projection = stage_tensors[0].get(PROJECTION) if stage_tensors else None
    if projection is None and weights:
        raise ValueError(f"stage 1 lacks {PROJECTION}, which W's rows follow")
    for weight in weights:
        _check_weight(projection, weight)


def _dense_parts(
    mean: Tensor | None, precision: Tensor | None, weight: Tensor | None, num_classes: int
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The dense class-covariance tensors checked against each other and the C classes (all None:
    the plain ridge); ValueError otherwise."""
    parts = (mean, precision, weight)
    if all(p is None for p in parts):
        return None, None, None
    if mean is None or precision is None or weight is None:
        raise ValueError("the class-covariance head needs cov_mean, cov_precision and cov_weight")
    width = mean.shape[-1]
    shapes = (tuple(mean.shape), tuple(precision.shape), weight.numel())
    if shapes != ((num_classes, width), (num_classes, width, width), 1):
        raise ValueError(
            f"class-covariance tensors of shapes {tuple(mean.shape)}, {tuple(precision.shape)}, "
            f"{tuple(weight.shape)} do not fit {num_classes} classes"
        )
    return mean.float().contiguous(), precision.float().contiguous(), weight.float().reshape(())


LOWRANK = ("cov_rotation", "cov_scale", "cov_center", "cov_const", "cov_factor", "cov_offset", "cov_factor_scale")


def joined_rows(stages: list[dict[str, Tensor]], name: str) -> Tensor:
    """Every stage's per-class rows of ``name``, in class order; ValueError when a stage lacks them or
    their shapes differ."""
    if any(name not in t for t in stages):
        raise ValueError(f"a stage lacks the class-covariance tensor {name} its newest stage uses")
    parts = [t[name] for t in stages]
    if len({tuple(p.shape[1:]) for p in parts}) != 1:
        raise ValueError(f"the stages' {name} tensors have different shapes")
    return torch.cat(parts)


def _check_lowrank(lowrank: LowRankPrecisions, num_classes: int) -> LowRankPrecisions:
    """The low-rank tensors' shapes against each other and the C classes; ValueError otherwise."""
    width = lowrank.rotation.shape[-1] if lowrank.rotation.dim() == 2 else -1
    rank = lowrank.factor.shape[-1] // max(num_classes, 1) if lowrank.factor.dim() == 2 else -1
    want = {
        "rotation": (width, width),
        "scale": (num_classes, width),
        "center": (num_classes, width),
        "const": (num_classes,),
        "factor": (width, num_classes * rank),
        "offset": (num_classes * rank,),
        "factor_scale": (),
    }
    for name, shape in want.items():
        if tuple(getattr(lowrank, name).shape) != shape or width < 1 or rank < 1:
            raise ValueError(
                f"low-rank class-covariance tensor {name} has shape {tuple(getattr(lowrank, name).shape)}, "
                f"not {shape} for {num_classes} classes"
            )
    if lowrank.factor.dtype not in (torch.float16, torch.float32) or not 0 < float(lowrank.factor_scale) < float("inf"):
        raise ValueError("the low-rank class covariances' factor is neither float16 with a positive scale nor float32")
    return lowrank


def _cov_params(params: Tensor) -> tuple[float, float, float]:
    """(w, a, b) as the newest stage stored them; ValueError outside their ranges."""
    if tuple(params.shape) != (3,):
        raise ValueError(f"{COV_PARAMS} has shape {tuple(params.shape)}, expected (3,)")
    cov_weight, shrink, blend = params.tolist()
    if not (0 <= cov_weight <= 100 and 0 <= shrink <= 1 and 0 <= blend <= 1):
        raise ValueError(f"{COV_PARAMS} {params.tolist()} is outside w [0, 100], a and b [0, 1]")
    return cov_weight, shrink, blend
