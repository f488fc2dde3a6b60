"""Issue 32, twelfth round: how far a first stage's images are from the PTM's own domain, read
from the PTM's ImageNet head (which the tool drops): the mean max-softmax probability (MSP) and
the mean entropy over the stage's training images, for the first 2 and the first 10 classes of
each class order (B2 Inc2's and B0 Inc10's stage 1), on the validation protocol's training part.

    python domain_signal.py --sketch /work/scratch/sketch --photos ../shared/data/caltech101 \
        --weights ../shared/data/deit_tiny_patch16_224/deit_tiny_patch16_224.safetensors

No training, one forward pass an image (one thread: about 3 minutes for the six stages).
"""

import argparse
from pathlib import Path

import timm
import torch
from PIL import Image
from safetensors.torch import load_file

from drlcli.benchmark.protocol import class_order, load_data, split_validation


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sketch", type=Path, required=True)
    parser.add_argument("--photos", type=Path, required=True)
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--seeds", default="1993,1994,1995")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False)
    model.load_state_dict(load_file(args.weights))  # with its ImageNet head
    model.eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    for name, root in (("sketch", args.sketch), ("photos", args.photos)):
        data = load_data(root, skip_classes={"BACKGROUND_Google"})
        for seed in map(int, args.seeds.split(",")):
            split = split_validation(data, 0.2, seed)
            order = class_order(list(split.train), seed=seed, shuffle=True)[:10]
            rows = []  # (class position, MSP, entropy) per image
            for position, cls in enumerate(order):
                paths = split.train[cls]
                for start in range(0, len(paths), 32):
                    batch = torch.stack([transform(Image.open(p).convert("RGB")) for p in paths[start : start + 32]])
                    with torch.no_grad():
                        probs = model(batch).softmax(-1)
                    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
                    rows += [(position, float(m), float(e)) for m, e in zip(probs.max(-1).values, entropy)]
            for first in (2, 10):
                part = [r for r in rows if r[0] < first]
                msp = sum(r[1] for r in part) / len(part)
                ent = sum(r[2] for r in part) / len(part)
                print(
                    f"{name} {seed} first {first:2d} classes: {len(part):4d} images, MSP {msp:.3f}, entropy {ent:.3f}"
                )


if __name__ == "__main__":
    main()
