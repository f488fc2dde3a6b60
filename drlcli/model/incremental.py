"""The incremental classifier: the IPA network plus the class list and its prototype bank.

Shared by every method: a method only decides which subspaces the network produces (SimpleCIL:
the PTM's alone; DRL: the PTM's and one per stage in one pass; EASE: one per stage, one pass
each) and how a stage is trained (see ``methods/``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Subset

from .. import distributed
from ..data import ImageDataset, LabelledImages, eval_transform, make_loader, start_workers
from ..features import StageNetwork
from ..heads.openset.rmd import CosineKnown, Moments, RmdKnown, open_set_bias, split_probe
from ..heads.prototypes import concat_scores, score_weights, synthesize, weighted_scores
from ..options import ScoreConfig
from ..precision import autocast


@dataclass
class IncrementalModel:
    """Everything inference needs. ``real_prototypes`` (C, S, d) is zero where synthesised."""

    network: StageNetwork  # IPANetwork or EaseNetwork: forward(images) -> (B, S, d)
    class_names: list[str]
    class_stage: Tensor  # (C,) 1-based stage of each class
    real_prototypes: Tensor  # (C, S, d)
    score_cfg: ScoreConfig
    data_config: dict[str, Any]
    offset: int = 1  # 1 when subspace 0 is the PTM's (drl, simplecil); 0 for ease
    head: nn.Module | None = None  # scores features instead of the prototype bank (heads/)
    unknown_bias: Tensor | None = None  # (C,) open-set biases (openset.py); None: never "unknown"
    unknown_rmd: tuple[Moments, Tensor] | None = None  # the rmd rule's moments and (C,) biases, if stored
    open_set_rule: str = "rmd"  # the run's open_set.score; cosine when the rmd statistics are missing
    # the rmd rule's probe block (``openset.probe_block``) and weight; None when its statistics are f_0's alone
    open_set_probe: int | None = None
    probe_weight: float = 1.0
    _bank: Tensor | None = field(default=None, repr=False)
    _scoring: dict[Any, Any] = field(default_factory=dict, repr=False)  # per device: scoring state, known module

    @property
    def num_subspaces(self) -> int:
        return self.offset + self.network.num_stages

    @property
    def num_stages(self) -> int:
        return int(self.class_stage.max()) if self.class_stage.numel() else 0

    def prototype_bank(self) -> Tensor:
        """Real prototypes with the missing subspaces synthesised (cached)."""
        if self._bank is None:
            self._bank = synthesize(self.real_prototypes, self.class_stage, tau=self.score_cfg.tau, offset=self.offset)
        return self._bank

    def add_classes(self, names: list[str], stage: int, prototypes: Tensor) -> None:
        """Append a stage's classes with their real prototypes (n, S, d) in every subspace."""
        self.class_names = self.class_names + list(names)
        new_stage = torch.full((len(names),), stage, dtype=torch.long)
        self.class_stage = torch.cat([self.class_stage, new_stage])
        old = self.real_prototypes
        if old.shape[1] < prototypes.shape[1]:  # a new subspace appeared: old classes lack it
            pad = old.new_zeros(old.shape[0], prototypes.shape[1] - old.shape[1], old.shape[2])
            old = torch.cat([old, pad], dim=1)
        self.real_prototypes = torch.cat([old, prototypes.to(old)])
        self.unknown_bias = self.unknown_rmd = None  # until the stage's classes are calibrated (``calibrated``)
        self._bank = None
        self._scoring.clear()

    def scoring_state(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The bank (C, S, d) and score weights (C, S) on ``device`` in ``dtype``: built once per device,
        dtype and scoring options, then reused, so that scoring a batch copies nothing to the GPU
        and indexes no CPU tensor with a GPU one (each a device sync)."""
        key = (torch.device(device), dtype, self.score_cfg)
        state = self._scoring.get(key)
        if state is None:
            bank, cfg = self.prototype_bank(), self.score_cfg
            weights = score_weights(
                self.class_stage.cpu(), bank.shape[1], rho=cfg.rho, beta=cfg.beta, offset=self.offset
            )
            state = self._scoring[key] = (bank.to(device, dtype), weights.to(device, dtype))
        return state

    def scores(self, features: Tensor) -> Tensor:
        """(B, C) class scores for subspace features (B, S, d) (with the head's layout rows, if any:
        what ``features`` gives, or ``split``'s first part)."""
        # always fp32, also under bf16 autocast: cosines of near-equal prototypes differ in the
        # third decimal, below bf16's resolution, and the (B, C) scoring is cheap next to the ViT
        features = features.float()
        with torch.autocast(features.device.type, enabled=False):
            if self.head is not None:  # the head lives on the model's device: features go to it (a no-op
                # for a batch from the network; one copy for evaluate's CPU features), not the head to them
                return self.head(features.to(_head_device(self.head)))
            bank, weights = self.scoring_state(features.device, torch.float32)
            if self.score_cfg.rule == "concat":
                return concat_scores(features, bank)
            return weighted_scores(features, bank, weights)

    @property
    def stages_scored(self) -> int | None:
        """How many stage subspaces scoring reads: an analytic head's own count (the default ``drl``
        head and the ridge method's read f_0 alone: 0); None for prototype scoring, which reads them all.
        The open-set score reads f_0 only. Inference computes no subspace beyond these."""
        if self.head is None:
            return None
        return self.head.stages_read(self.network.width)

    @property
    def layout_scored(self) -> int:
        """g of the PTM layout rows an analytic head reads after the subspaces (``backbone.ptm_layout``;
        the default ``drl`` head's); 0: none."""
        return 0 if self.head is None else self.head.layout_grid

    @property
    def probes_read(self) -> tuple[int, ...]:
        """The PTM blocks whose class tokens the "unknown" answer reads (rows after the head's)."""
        return (self.open_set_probe,) if self.open_set_answer == "rmd" and self.open_set_probe is not None else ()

    @property
    def rmd_width(self) -> int:
        """Width of the rmd rule's input (``openset.rmd_input``): d, or 2d with a probe block."""
        return self.network.width * (1 if self.open_set_probe is None else 2)

    def features(self, images: Tensor, *, open_set: bool = False) -> Tensor:
        """The features scoring reads, (B, S', d), of a preprocessed batch: one network pass. The
        subspaces first, then the head's layout rows if it reads any; with ``open_set``, also
        ``probes_read``'s rows after them (``split`` parts them for ``scores`` and ``known``)."""
        return self.network(images, self.stages_scored, self.layout_scored, self.probes_read if open_set else ())

    def split(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """``features(open_set=True)``'s output as (what ``scores`` reads, what ``known`` reads)."""
        return split_probe(features, len(self.probes_read), self.probe_weight)

    def score_images(self, images: Tensor) -> Tensor:
        """(B, C) class scores for a preprocessed image batch (B, 3, H, W): one network pass."""
        return self.scores(self.features(images))

    @property
    def open_set_answer(self) -> str | None:
        """The rule the "unknown" answer uses (``openset.RULES``); None when uncalibrated."""
        if self.unknown_bias is None:
            return None
        return "rmd" if self.open_set_rule == "rmd" and self.unknown_rmd is not None else "cosine"

    def known_module(self) -> nn.Module | None:
        """known(x) of ``openset.py`` as a module of constants on the CPU, ``split``'s second part -> (B,)."""
        rule = self.open_set_answer
        if rule is None:
            return None
        if rule == "rmd":
            assert self.unknown_rmd is not None
            moments, bias = self.unknown_rmd
            return RmdKnown(moments, open_set_bias(bias))
        assert self.unknown_bias is not None
        return CosineKnown(self.real_prototypes[:, 0].cpu(), open_set_bias(self.unknown_bias.cpu()))

    def known(self, inputs: Tensor) -> Tensor | None:
        """known(x) (B,) of ``openset.py`` for its inputs (B, w), ``split``'s second part; None when
        uncalibrated."""
        if self.unknown_bias is None:
            return None
        key = ("open_set", torch.device(inputs.device))
        module = self._scoring.get(key)
        if module is None:  # built once per device
            module = self._scoring[key] = self.known_module().to(inputs.device)
        with torch.autocast(inputs.device.type, enabled=False):
            return module(inputs)

    def classify(self, images: Tensor) -> tuple[Tensor, Tensor | None]:
        """Class scores (B, C) and known(x) (B,) (None when uncalibrated) from one network pass."""
        scoring, inputs = self.split(self.features(images, open_set=True))
        return self.scores(scoring), self.known(inputs)

    def calibrated(self, bias: Tensor, rmd: tuple[Moments, Tensor] | None = None) -> None:
        """Set the open-set biases of every class (C,), and the rmd rule's moments and biases (C,).
        Moments of f_0 alone (a run learned before the probe block) drop the probe block."""
        if rmd is not None:
            width = rmd[0].means.shape[1]
            if width == self.network.width:
                self.open_set_probe = None
            elif width != self.rmd_width:
                raise ValueError(f"the rmd statistics are {width} wide, expected {self.rmd_width}")
        self.unknown_bias = bias.float()
        self.unknown_rmd = None if rmd is None else (rmd[0], rmd[1].float())
        self._scoring.clear()

    @property
    def device(self) -> torch.device:
        return _device_of(self.network)

    def class_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.class_names)}


def empty_prototypes(width: int, offset: int = 1) -> Tensor:
    return torch.zeros(0, offset, width)


def _device_of(network: StageNetwork) -> torch.device:
    return next(network.ptm.parameters()).device


def _head_device(head: nn.Module) -> torch.device:
    """Where an analytic head's tensors (buffers, no parameters) are."""
    return next(head.buffers()).device


@torch.inference_mode()
def embed_images(
    network: StageNetwork,
    images: LabelledImages,
    data_config: dict[str, Any],
    *,
    batch_size: int,
    num_workers: int = 0,
    precision: str = "fp32",
    indices: list[int] | None = None,
    progress: Any = None,
    stages: int | None = None,
    layout: int = 0,
    probes: tuple[int, ...] = (),
) -> tuple[Tensor, Tensor]:
    """Subspace features (N, S, d), fp32 on the CPU, of every image (eval transform) and their local
    labels (N,); only the images at ``indices`` when given (a process's shard), only the subspaces
    of the first ``stages`` stages when given, followed by the PTM's layout rows with ``layout`` g > 0
    (N, S + g², d), then the class tokens of the PTM blocks ``probes``. The forward runs in
    ``precision`` (``precision.autocast``)."""
    device = _device_of(network)
    dataset = ImageDataset(images, eval_transform(data_config))
    loader = make_loader(
        dataset if indices is None else Subset(dataset, indices),
        batch_size=batch_size,
        device=device,
        num_workers=num_workers,
        shuffle=False,
    )
    feats, labels = [], []
    if len(loader.dataset) == 0:  # an empty shard
        width = network.num_subspaces if stages is None else network.num_subspaces - network.num_stages + stages
        return torch.zeros(0, width + layout**2 + len(probes), network.width), torch.zeros(0, dtype=torch.long)
    for step, (batch, target) in enumerate(start_workers(loader), 1):
        with autocast(device, precision):
            out = network(batch.to(device, non_blocking=True), stages, layout, probes)  # (B, S', d)
        feats.append(out.float().cpu())
        labels.append(target)
        if progress is not None:
            progress(step, len(loader))
    return torch.cat(feats), torch.cat(labels)


def class_means(features: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """Mean feature per class: (N, S, d) -> (num_classes, S, d); sums and counts are added up
    over all processes when several run (each holding a shard of the images)."""
    sums = torch.zeros(num_classes, *features.shape[1:])
    sums.index_add_(0, labels, features)
    counts = torch.bincount(labels, minlength=num_classes).float()
    sums, counts = distributed.all_reduce_sum(sums), distributed.all_reduce_sum(counts)
    return sums / counts.clamp_min(1)[:, None, None]
