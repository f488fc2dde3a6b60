"""Cost of the feature pass with every stage subspace against the pass a run that skips unread
stages makes (f_0, the 2 x 2 layout and the probe block's class token), on a random DeiT-Tiny.

    python benchmarks/research/skip_unread/pass_cost.py --stages 10 --batch 32 --threads 2
"""

from __future__ import annotations

import argparse
import time

import timm
import torch

from drlcli.config import RunConfig
from drlcli.ipa import IPANetwork


def best_of(network: IPANetwork, images: torch.Tensor, repeats: int, **kwargs) -> float:
    with torch.no_grad():
        network(images, **kwargs)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            network(images, **kwargs)
            times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ptm = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    network = IPANetwork(ptm, RunConfig.for_method("drl", preset="frozen").ipa)
    for k in range(args.stages):
        network.new_stage(seed=k)
    network.eval().requires_grad_(False)
    images = torch.randn(args.batch, 3, 224, 224)
    read = best_of(network, images, args.repeats, stages=0, layout=2, probes=(7,))
    every = best_of(network, images, args.repeats, stages=None, layout=2, probes=(7,))
    print(f"read only: {read:.3f} s   every subspace ({args.stages} stages): {every:.3f} s   ratio {every / read:.2f}")


if __name__ == "__main__":
    main()
