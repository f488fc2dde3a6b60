"""Issue 32: do the GPU's embeddings (gpu_oracle.py, stored in float16) match a CPU embedding with the same adapters?

    python embed_check.py FEATURES.pt ADAPTERS.pt KEY     # e.g. joint-ce20-1993.pt adapters.pt joint-ce20-1993

Embeds 64 of the images (every 90th) here and prints the largest and the relative difference.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from first_stage import WEIGHTS, Adapted  # noqa: E402

from drlcli.data import ImageDataset, ImageSet, eval_transform  # noqa: E402
from drlcli.methods.ease.options import EaseConfig  # noqa: E402
from drlcli.ptm import backbone  # noqa: E402
from drlcli.ptm.backbone import PTMSource  # noqa: E402

torch.set_num_threads(2)
g = torch.load(sys.argv[1])
idx = list(range(0, len(g["paths"]), 90))[:64]
rels = [g["paths"][i] for i in idx]
ptm = backbone.create_ptm("deit_tiny_patch16_224", source=PTMSource(weights_path=WEIGHTS))
net = Adapted(ptm, EaseConfig(adapter_dim=64)).eval()
net.new_stage(seed=1993)
net.stages[-1].load_state_dict(torch.load(sys.argv[2])[sys.argv[3]])
root = Path("/work/scratch/sketch/101_ObjectCategories")
images = ImageSet(Path("/work/scratch/sketch"), ("x",), tuple(root / r for r in rels), (0,) * len(rels))
cfg = backbone.data_config(ptm)
batch = torch.stack([ImageDataset(images, eval_transform(cfg))[i][0] for i in range(len(rels))])
cpu = net.embed(batch).float()
gpu = g["features"][idx].float()
print(
    "max abs diff",
    (cpu - gpu).abs().max().item(),
    "max abs value",
    gpu.abs().max().item(),
    "rel",
    ((cpu - gpu).norm() / gpu.norm()).item(),
)
