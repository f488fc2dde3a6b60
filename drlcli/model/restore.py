"""Rebuilding a model from named tensors: the one loader of stages, behind ``load_run`` and ``load_export``.

Both a run directory and a ``.drl`` export come down to the same set of tensors, under these
names (the ``.drl`` file's own; a run's names are mapped to them in ``api.load_run``)::

    stage.<i>.<param>   stage i's network parameters (i from 0; trained methods only)
    head.<name>         the analytic head's state (an analytic method's; drl with score.head ridge), when there is one
    prototypes          (C, S, d) real prototypes of every class, zero where synthesised
    class_stage         (C,) the 1-based stage each class was learned in
    unknown_bias        (C,) the open-set biases (``openset.py``), when every stage calibrated them
    unknown_mean, unknown_count, unknown_rmd_bias (C, w), (C,), (C,); unknown_scatter (w, w),
    unknown_scatter_counts (2,): the rmd rule's statistics (``openset.RMD_TENSORS``), when every
                        stage stored them; w is the rmd input's width (``IncrementalModel.rmd_width``:
                        2d with the probe block, d for f_0 alone)

Each format checks its own files (checksums, shapes, finiteness) before calling ``restore_model``;
weights that still do not fit the network are reported through the caller's ``fit_error``, so a
run names the stage and an export names the file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from ..heads import PROTOTYPES
from ..heads.openset import BIAS, RMD_BIAS, RMD_MEAN, RMD_TENSORS
from ..heads.openset.rmd import Moments, check_bias, check_rmd, probe_block
from ..methods import head_of, method_of
from .incremental import IncrementalModel

if TYPE_CHECKING:
    from ..config import RunConfig

STAGE = "stage.{}."
HEAD = "head."
CLASS_STAGE = "class_stage"

FitError = Callable[[int | None, Exception], Exception]  # (stage position or None for the head, cause)


def stage_prefix(position: int) -> str:
    """The name prefix of the stage at ``position`` (0 for the first stage)."""
    return STAGE.format(position)


def with_prefix(tensors: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The tensors named ``prefix...``, with the prefix taken off."""
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def restore_model(
    ptm: nn.Module,
    config: RunConfig,
    tensors: Mapping[str, Tensor],
    *,
    class_names: list[str],
    num_stages: int,
    data_config: dict[str, Any],
    fit_error: FitError,
) -> IncrementalModel:
    """The model of ``config``'s method on ``ptm``: ``num_stages`` frozen stages, the prototype bank
    and the head, from ``tensors`` named as the module docstring says. Stages and head are placed
    on the PTM's device; the prototype bank stays where it is."""
    method = method_of(config)
    network = method.build(ptm, config)
    for position in range(num_stages):
        try:
            stage = network.new_stage(seed=0)
            stage.load_state_dict(with_prefix(tensors, stage_prefix(position)), strict=True)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise fit_error(position, exc) from exc
        stage.requires_grad_(False)
        stage.eval()
    model = IncrementalModel(
        network=network,
        class_names=list(class_names),
        class_stage=tensors[CLASS_STAGE],
        real_prototypes=tensors[PROTOTYPES],
        score_cfg=config.score,
        data_config=data_config,
        offset=method.offset,
        head=_head(config, tensors, network, fit_error, len(class_names)) if class_names else None,
        open_set_rule=config.open_set.score,
        open_set_probe=probe_block(config.open_set.probe_depth, len(ptm.blocks)) if method.offset else None,
        probe_weight=config.open_set.probe_weight,
    )
    if BIAS in tensors:
        model.calibrated(tensors[BIAS], _rmd(model, tensors, fit_error))
    return model


def _head(
    config: RunConfig, tensors: Mapping[str, Tensor], network: nn.Module, fit_error: FitError, num_classes: int
) -> nn.Module | None:
    """The analytic head from its state (``head.*``), scoring ``num_classes`` classes, on the PTM's
    device; None for the prototype bank."""
    analytic = head_of(config)
    if analytic is None:
        return None
    try:
        head = analytic.load().from_state(with_prefix(tensors, HEAD))
        head.check_width(network.width)
        if getattr(head, "num_classes", num_classes) != num_classes:
            raise ValueError(f"the head scores {head.num_classes} classes, not the model's {num_classes}")
    except (RuntimeError, KeyError, ValueError) as exc:
        raise fit_error(None, exc) from exc
    return head.to(next(network.ptm.parameters()).device)


def _rmd(model: IncrementalModel, tensors: Mapping[str, Tensor], fit_error: FitError) -> tuple[Moments, Tensor] | None:
    """The rmd rule's moments and biases when the tensors hold them (checked with the biases)."""
    num_classes = len(model.class_names)
    problem, rmd = check_bias(tensors[BIAS], num_classes), None
    if problem is None and all(name in tensors for name in RMD_TENSORS):
        rmd_tensors = {name: tensors[name] for name in RMD_TENSORS}
        means = rmd_tensors[RMD_MEAN]  # d wide (f_0's: runs from before the probe block) or the model's
        wide = means.dim() == 2 and means.shape[-1] == model.network.width
        problem = check_rmd(rmd_tensors, num_classes, means.shape[-1] if wide else model.rmd_width)
        rmd = (Moments.from_tensors(rmd_tensors), tensors[RMD_BIAS])
    if problem is not None:
        raise fit_error(None, ValueError(problem))
    return rmd


def model_tensors(model: IncrementalModel) -> dict[str, Tensor]:
    """The inverse of ``restore_model`` (the PTM aside): a model's tensors under the names above."""
    tensors: dict[str, Tensor] = {}
    for position, stage in enumerate(model.network.stages):
        tensors.update({stage_prefix(position) + k: v for k, v in stage.state_dict().items()})
    if model.head is not None:
        tensors.update({HEAD + k: v for k, v in model.head.state_dict().items()})
    tensors[PROTOTYPES] = model.real_prototypes
    tensors[CLASS_STAGE] = model.class_stage
    if model.unknown_bias is not None:
        tensors[BIAS] = model.unknown_bias
    if model.unknown_rmd is not None:
        moments, bias = model.unknown_rmd
        tensors.update(moments.tensors())
        tensors[RMD_BIAS] = bias
    return tensors
