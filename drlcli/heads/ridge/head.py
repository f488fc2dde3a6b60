"""The ridge head as a module (see the folder's docstring): the random projection R, the head's
input (f_0, stage 1's subspace if read, the PTM's layout rows), and ``RanpacHead``, which scores
ReLU(h R) W, plus the class covariances' term."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import COV_COVARIANCE, COV_MEAN, COV_PARAMS, COV_SHARED, LAYOUT, PROJECTION, WEIGHT
from .covariance import covariance_input, precisions, standardise
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
        raise ValueError(f"{LAYOUT} must be one int64 in [0, {MAX_LAYOUT_GRID}], got {value.dtype} {value.tolist()}")
    return int(value)


def expand(features: Tensor, projection: Tensor) -> Tensor:
    """φ = ReLU(h R): (N, d) -> (N, M), in the projection's dtype."""
    return F.relu(features.to(projection) @ projection)


class RanpacHead(nn.Module):
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
    ):
        super().__init__()
        self.layout_grid = layout  # g: the input ends with the PTM's g² layout rows (0: none)
        self.register_buffer("layout", torch.tensor(layout) if layout else None)
        self.register_buffer("projection", projection.float().contiguous())  # (d, M)
        self.register_buffer("weight", weight.float().contiguous())  # (M, C)
        parts = (cov_mean, cov_precision, cov_weight)
        if any(p is not None for p in parts):
            if any(p is None for p in parts):
                raise ValueError("the class-covariance head needs cov_mean, cov_precision and cov_weight")
            num_classes, width = weight.shape[1], cov_mean.shape[-1]
            if (
                tuple(cov_mean.shape) != (num_classes, width)
                or tuple(cov_precision.shape) != (num_classes, width, width)
                or cov_weight.numel() != 1
            ):
                raise ValueError(
                    f"class-covariance tensors of shapes {tuple(cov_mean.shape)}, {tuple(cov_precision.shape)}, "
                    f"{tuple(cov_weight.shape)} do not fit {num_classes} classes"
                )
            parts = tuple(p.float().contiguous() for p in (cov_mean, cov_precision, cov_weight.reshape(())))
        self.register_buffer("cov_mean", parts[0])  # (C, d); None: plain ridge (RanPAC's)
        self.register_buffer("cov_precision", parts[1])  # (C, d, d)
        self.register_buffer("cov_weight", parts[2])  # () w

    def forward(self, features: Tensor) -> Tensor:
        # the head lives on the model's device and scores in fp32 (``IncrementalModel.scores``): no
        # per-batch copy, and no `.to(features)` that a traced graph would record with its device
        cells = self.layout_grid**2
        phi = F.relu(head_input(features, self.projection.shape[0], cells) @ self.projection)  # (B, M)
        scores = phi @ self.weight
        if self.cov_mean is None:
            return scores
        diff = covariance_input(features)[:, None, :] - self.cov_mean  # (B, C, d)
        distance = (torch.einsum("bcd,cde->bce", diff, self.cov_precision) * diff).sum(-1)  # (B, C)
        return standardise(scores) - self.cov_weight * standardise(distance)

    def check_width(self, width: int) -> None:
        """ValueError unless the head reads one or two subspaces of the network's ``width`` (and its
        layout rows) and its class covariances have that width."""
        cells = self.layout_grid**2
        rows = self.projection.shape[0] if self.projection.dim() == 2 else -1
        allowed = [width * (subspaces + cells) for subspaces in (1, 2)]
        if rows not in allowed:
            raise ValueError(f"the head's projection has {rows} input rows, not {' or '.join(map(str, allowed))}")
        if self.cov_mean is not None and self.cov_mean.shape[-1] != width:
            raise ValueError(f"the class covariances have width {self.cov_mean.shape[-1]}, not the network's {width}")

    def stages_read(self, width: int) -> int:
        """How many stage subspaces after f_0 the head reads (0: f_0 alone, RanPAC's)."""
        return self.projection.shape[0] // width - self.layout_grid**2 - 1

    @classmethod
    def from_state(cls, state: dict[str, Tensor]) -> RanpacHead:
        return cls(
            state["projection"],
            state["weight"],
            state.get("cov_mean"),
            state.get("cov_precision"),
            state.get("cov_weight"),
            layout=check_layout(state.get("layout")),
        )

    @classmethod
    def from_stages(cls, stage_tensors: list[dict[str, Tensor]]) -> RanpacHead:
        """R from stage 1's weights, W (and, with class covariances, S and w, a, b) from the newest
        stage's, μ_c and S_c from each class's own stage."""
        first = stage_tensors[0]
        layout = check_layout(first.get(LAYOUT))
        return cls.assemble(first[PROJECTION], stage_tensors[-1], stage_tensors, layout=layout)

    @classmethod
    def assemble(
        cls, projection: Tensor, newest: dict[str, Tensor], stages: list[dict[str, Tensor]], *, layout: int = 0
    ) -> RanpacHead:
        """The head from R, the newest stage's tensors and every stage's (for μ_c and S_c); ``layout``
        g as stage 1 stored it."""
        weight = newest[WEIGHT]
        if COV_PARAMS not in newest:
            return cls(projection, weight, layout=layout)
        if any(COV_MEAN not in t or COV_COVARIANCE not in t for t in stages) or COV_SHARED not in newest:
            raise ValueError("a stage lacks the class-covariance tensors its newest stage uses")
        cov_weight, shrink, blend = _cov_params(newest[COV_PARAMS])
        covariances = torch.cat([t[COV_COVARIANCE] for t in stages])
        shared = newest[COV_SHARED]
        if covariances.dim() != 3 or tuple(shared.shape) != tuple(covariances.shape[1:]):
            raise ValueError(f"{COV_SHARED} has shape {tuple(shared.shape)}, not one class covariance's")
        return cls(
            projection,
            weight,
            torch.cat([t[COV_MEAN] for t in stages]),
            precisions(covariances, shared, shrink=shrink, blend=blend),
            torch.tensor(cov_weight),
            layout=layout,
        )


def _cov_params(params: Tensor) -> tuple[float, float, float]:
    """(w, a, b) as the newest stage stored them; ValueError outside their ranges."""
    if tuple(params.shape) != (3,):
        raise ValueError(f"{COV_PARAMS} has shape {tuple(params.shape)}, expected (3,)")
    cov_weight, shrink, blend = params.tolist()
    if not (0 <= cov_weight <= 100 and 0 <= shrink <= 1 and 0 <= blend <= 1):
        raise ValueError(f"{COV_PARAMS} {params.tolist()} is outside w [0, 100], a and b [0, 1]")
    return cov_weight, shrink, blend
