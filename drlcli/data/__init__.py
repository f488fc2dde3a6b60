"""Images: listing class folders and datasets (``images.py``), decoding them safely and bounded
(``decode.py``), and turning them into batches (``loading.py``)."""

from .decode import MAX_ASPECT, MAX_DECODE_SIDE, ImagePathError, load_rgb, to_rgb
from .images import (
    DatasetImages,
    ImageSet,
    ImageSubset,
    LabelledImages,
    class_key,
    dataset_images,
    image_extensions,
    refuse_near_duplicates,
    scan_class_folders,
    validate_images,
)
from .loading import ImageDataset, check_workers, eval_transform, make_loader, start_workers, train_transform

__all__ = [
    "MAX_ASPECT",
    "MAX_DECODE_SIDE",
    "DatasetImages",
    "ImageDataset",
    "ImagePathError",
    "ImageSet",
    "ImageSubset",
    "LabelledImages",
    "check_workers",
    "class_key",
    "dataset_images",
    "eval_transform",
    "image_extensions",
    "load_rgb",
    "make_loader",
    "refuse_near_duplicates",
    "scan_class_folders",
    "start_workers",
    "to_rgb",
    "train_transform",
    "validate_images",
]
