"""Issue 32, sixth round: where in depth does the oracle's gain live? The oracle's adapters (one
AdaptFormer set trained on all 101 classes, ``gpu_oracle.py train``) are kept in some blocks and
removed (Up and its bias zeroed) in the rest, the kept ones' outputs optionally scaled (``--scale``:
extrapolating a set along its own direction); the fit and held-out images of the validation split are
embedded (class token and 2 x 2 layout) and the default head replayed over B0 Inc10 (``post_ptm.score``).

    python depth.py --data SKETCH --adapters adapters.pt --key joint-ce20-1993 --seed 1993 --blocks 0-5,6-11
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cov_rank"))
from first_stage import WEIGHTS, Adapted, depth_blocks  # noqa: E402
from post_ptm import score  # noqa: E402
from replay import plan  # noqa: E402

from drlcli.config import RunConfig  # noqa: E402
from drlcli.data import ImageDataset, ImageSet, eval_transform  # noqa: E402
from drlcli.methods.ease.options import EaseConfig  # noqa: E402
from drlcli.ptm import backbone  # noqa: E402
from drlcli.ptm.backbone import PTMSource  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--adapters", type=Path, required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--seed", type=int, default=1993)
    parser.add_argument("--blocks", required=True, help="comma-separated block sets: 0-5,6-11,0-3+8-11")
    parser.add_argument("--scale", type=float, default=1.0, help="the kept adapters' outputs times this")
    parser.add_argument("--out", type=Path, help="JSON lines appended here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    data, stages = plan([args.data], args.seed, "val")
    config = RunConfig.for_method("drl", {"ranpac": {"covariance_rank": 0}}, preset="frozen").with_train(seed=args.seed)
    ptm = backbone.create_ptm("deit_tiny_patch16_224", source=PTMSource(weights_path=WEIGHTS))
    net = Adapted(ptm, EaseConfig(adapter_dim=64)).eval()
    net.new_stage(seed=args.seed)
    trained = torch.load(args.adapters)[args.key]
    paths = sorted(
        {str(p) for ps in data.train.values() for p in ps} | {str(p) for ps in data.test.values() for p in ps}
    )
    images = ImageSet(args.data, ("x",), tuple(Path(p) for p in paths), (0,) * len(paths))
    loader = torch.utils.data.DataLoader(ImageDataset(images, eval_transform(backbone.data_config(ptm))), batch_size=64)
    for text in args.blocks.split(","):
        keep = torch.zeros(len(ptm.blocks))
        keep[depth_blocks(text)] = args.scale
        state = dict(trained)
        state["up"] = trained["up"] * keep[:, None, None]
        state["up_bias"] = trained["up_bias"] * keep[:, None]
        net.stages[-1].load_state_dict(state)
        tick = time.time()
        feats = torch.cat([net.embed(batch).float() for batch, _ in loader])
        lookup = dict(zip(paths, feats))
        record = {"key": args.key, "seed": args.seed, "blocks": text, "scale": args.scale}
        record["embed_s"] = round(time.time() - tick)
        record |= score(data, stages, lookup, config)
        print(json.dumps(record), flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
