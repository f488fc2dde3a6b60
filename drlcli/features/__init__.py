"""What the head reads: the feature networks over the frozen PTM, one of the three parts of a recipe
(``recipes.py``: features x schedule x head).

- ``ipa/``: the paper's Incremental Parallel Adapter streams, the PTM's subspace and one per stage in
  one pass; with no stage, the frozen PTM alone (the recipes that train nothing).
- ``adapter/``: one AdaptFormer set inside the PTM (``ranpac-published`` trains it in stage 1; the
  default trains it again at every stage).
- ``ease/``: one independent AdaptFormer set per stage (the EASE baseline).
- ``losses.py``: what they train with: DAS (the paper's), cross-entropy, distillation.

Each package's ``__init__`` holds its run-config section and its ``build(ptm, config)``, and imports no
torch (``drl --help`` stays fast); its ``network.py`` is the module, imported when first built.
To add a feature network: a package here with both, then a method naming its builder (``methods/``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor, nn


@runtime_checkable
class StageNetwork(Protocol):
    """A method's network: the frozen PTM and one trainable module per learned stage
    (``ipa.IPANetwork``, ``ease.EaseNetwork``); an ``nn.Module``, so ``network(images)`` is ``forward``.

    Each stage module has ``num_params()``. Stages are appended by ``new_stage`` and frozen by
    the caller once trained (or loaded); a stage's state dict is what a run stores under the
    method's ``tensor_prefix``.
    """

    ptm: nn.Module  # frozen
    width: int  # d
    stages: nn.ModuleList

    @property
    def num_stages(self) -> int: ...

    @property
    def num_subspaces(self) -> int:
        """S, the width of ``forward``'s subspace axis: the method's offset + num_stages."""
        ...

    def new_stage(self, *, seed: int) -> nn.Module:
        """Append a freshly initialised stage (seeded, on the PTM's device) and return it (a carried
        network, ``Schedule.carries``, reopens its one stage instead)."""
        ...

    def forward(
        self, images: Tensor, stages: int | None = None, layout: int = 0, probes: tuple[int, ...] = ()
    ) -> Tensor:
        """Every subspace's feature: (B, 3, H, W) -> (B, S, d); with ``stages`` k, only the subspaces
        of the PTM (when the method has one) and of the first k stages, the others not computed;
        with ``layout`` g > 0, g² rows of the PTM's layout after them (``backbone.ptm_layout``);
        with ``probes``, the class token after each of those PTM blocks last (``backbone.ptm_probe``;
        layout and probes: methods with a PTM subspace only)."""
        ...

    def forward_train(self, images: Tensor) -> tuple[Tensor, ...]:
        """(PTM feature (B, d) or None, newest stage's feature (B, d), *loss terms of the network's own),
        gradients for the newest stage only."""
        ...


__all__ = ["StageNetwork"]
