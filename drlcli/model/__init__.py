"""The model inference needs (``incremental.py``: the network, the classes, the prototype bank or
an analytic head, the "unknown" answer; the feature pass), and rebuilding it from named tensors,
for runs and ``.drl`` files alike (``restore.py``)."""

from .incremental import IncrementalModel, class_means, embed_images, empty_prototypes
from .restore import CLASS_STAGE, HEAD, model_tensors, restore_model, stage_prefix, with_prefix

__all__ = [
    "CLASS_STAGE",
    "HEAD",
    "IncrementalModel",
    "class_means",
    "embed_images",
    "empty_prototypes",
    "model_tensors",
    "restore_model",
    "stage_prefix",
    "with_prefix",
]
