"""Check: extract.py's timm f_0 equals drlcli's own path (IPANetwork with 0 stages + model.embed_images)
on the first 8 cached Caltech train images.   python extract_check.py"""
import json
from pathlib import Path

import numpy as np
import torch
from extract import HERE, PTM, WEIGHTS

from drlcli import backbone
from drlcli.backbone import PTMSource
from drlcli.config import IPAConfig
from drlcli.data import ImageSet
from drlcli.ipa import IPANetwork
from drlcli.model import embed_images

torch.set_num_threads(1)
meta = json.loads((HERE / "feats/caltech/meta.json").read_text())
items = meta["parts"]["train"][:8]
ptm = backbone.create_ptm(PTM, source=PTMSource(weights_path=WEIGHTS))
net = IPANetwork(ptm, IPAConfig()).eval()
paths = tuple(Path(p) for p, _ in items)
imgs = ImageSet(root=paths[0].parents[1], class_names=tuple(meta["classes"]), paths=paths, labels=tuple(y for _, y in items))
f, _ = embed_images(net, imgs, backbone.data_config(ptm), batch_size=8)
cached = np.load(HERE / "feats/caltech/train_0000.npy")[:8]
print("max abs diff drlcli vs cache:", float(np.abs(f[:, 0].numpy() - cached).max()), "feature norm", float(np.linalg.norm(cached, axis=1).mean()))
