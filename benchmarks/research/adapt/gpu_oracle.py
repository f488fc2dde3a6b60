"""Issue 32, bounds on a lent GPU: how much can adapting DeiT-Tiny on Caltech-101-Sketch give the default head at all?

First-session adaptation gave at most +0.74 A_T on validation (``first-session-peft.md``). This script
bounds the directions that adapt beyond stage 1 by giving them what no run has: every class's training
images, and old classes' statistics recomputed on the final features (no drift to compensate).

- ``joint``: one AdaptFormer set (r 64, s 0.1, every block) trained on the fit images of all 101
  classes at once (one cosine classifier over 101 classes): the features any adaptation of this PTM with
  these images could reach in one stream.
- ``continual``: the same adapter set trained stage after stage on each stage's classes only (B0
  Inc10, a new cosine classifier per stage, the adapters carried on): per-stage adapters merged into
  one stream, as MOS / TUNA-like methods keep one, with old-class statistics recomputed (an oracle).

Every training image is then embedded by the adapted network (f and the 2 x 2 layout, as
``first_stage.py embed``) and the whole B0 Inc10 run is replayed here by the product's own head
(``../cov_rank/replay.py``): the A_T these features allow.

The images travel as Caltech-101 photos in two parts (the device tool carries 64 MiB a call) and are
redrawn there by the data set's own generator, checked against the sha256 of the sketches here:

    python gpu_oracle.py pack --sketch /work/scratch/sketch --shared ../shared/data --out .devA,.devB
    # device call 1 (carry .devA): python3 gpu_oracle.py draw --src .devA --dst /tmp/sketch
    # device call 2 (carry .devB), on the same warm machine:
    python3 gpu_oracle.py draw --src .devB --dst /tmp/sketch && python3 gpu_oracle.py train \
        --manifest .devB/manifest.json --weights /tmp/weights.safetensors --sketches /tmp/sketch --out $OUT
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from drlcli.data import ImageDataset, ImageSet, eval_transform
from drlcli.methods.ease.options import EaseConfig
from drlcli.options import TrainConfig
from drlcli.ptm import backbone
from drlcli.ptm.backbone import PTMSource
from drlcli.stage import train as stage_train
from drlcli.stage.train import initial_class_means, train_stage

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cov_rank"))
from carry import Carry, replay_carried  # noqa: E402
from first_stage import Adapted, embed_images, learn_only, plan  # noqa: E402
from gpu_adapt import persistent  # noqa: E402

# name -> (kind, order, loss, epochs, lr)
EXPERIMENTS = {
    "joint-ce20-1993": ("joint", 1993, "ce", 20, 0.01),
    "cont-ce5-1993": ("continual", 1993, "ce", 5, 0.01),
    "joint-das20-1993": ("joint", 1993, "das", 20, 0.01),
    "joint-ce20-1994": ("joint", 1994, "ce", 20, 0.01),
}
B2 = ("inc=2", "stages=5")  # a first stage of 2 classes: B2 Inc2 over the same class order, its first 5 stages
# ``staged``: the realistic protocol. name -> (order, loss, epochs, lr, kd, (stage-1 epochs, lr) or None)
STAGED = {
    "frozen-1993": (1993, "ce", 0, 0.0, 0.0, None),
    "slow-ce10-1993": (1993, "ce", 10, 0.001, 0.0, None),
    "slow-das10-1993": (1993, "das", 10, 0.001, 0.0, None),
    "fs20-slow-ce10-1993": (1993, "ce", 10, 0.001, 0.0, (20, 0.01)),
    "slow-ce10-kd2-1993": (1993, "ce", 10, 0.001, 2.0, None),
    "cont-ce5-1993": (1993, "ce", 5, 0.01, 0.0, None),
    # each stage's classifier also holds the earlier classes, as their stored class means (frozen)
    "seen-ce5-1993": (1993, "ce", 5, 0.01, 0.0, None, "seen"),
    # seventh round: only blocks 0-5 learn (where the oracle's gain lives), with a larger step
    "b05-ce10-lr05-1993": (1993, "ce", 10, 0.05, 0.0, None, "blocks=0-5"),
    "b05-das10-lr05-1993": (1993, "das", 10, 0.05, 0.0, None, "blocks=0-5"),
    "b05-seen-ce10-lr05-1993": (1993, "ce", 10, 0.05, 0.0, None, "seen", "blocks=0-5"),
    "b05-ce10-lr1-1993": (1993, "ce", 10, 0.1, 0.0, None, "blocks=0-5"),
    "ce10-lr05-1993": (1993, "ce", 10, 0.05, 0.0, None),
    "b05-ce10-lr05-1994": (1994, "ce", 10, 0.05, 0.0, None, "blocks=0-5"),
    # the later stages learn only where the earlier images' adapter inputs have little energy
    "b05-ce10-lr05-null97-1993": (1993, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "null=0.97"),
    "b05-ce10-lr05-null90-1993": (1993, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "null=0.9"),
    "b05-ce5-lr05-null97-1993": (1993, "ce", 5, 0.05, 0.0, None, "blocks=0-5", "null=0.97"),
    "b05-ce5-lr05-null95-1993": (1993, "ce", 5, 0.05, 0.0, None, "blocks=0-5", "null=0.95"),
    # eighth round: from stage 2 on, the read tokens of the stage's images are held near where the
    # stage's starting adapters put them (a relative squared distance, times w)
    "b05-ce10-lr05-dist10-1993": (1993, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=10"),
    "b05-ce10-lr05-dist100-1993": (1993, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=100"),
    "b05-ce10-lr05-dist3-1993": (1993, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=3"),
    "b05-ce10-lr05-dist10-1994": (1994, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=10"),
    "b05-ce10-lr05-dist3-1994": (1994, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=3"),
    "b05-ce10-lr05-dist10-1995": (1995, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=10"),
    "b05-ce10-lr05-dist3-1995": (1995, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=3"),
    # ninth round: a weaker pull (its bound fell from +5.05 to +3.94 capped at w 3 on order 1993), longer stages
    "b05-ce10-lr05-dist1-1993": (1993, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=1"),
    "b05-ce10-lr05-dist1-1994": (1994, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=1"),
    "b05-ce10-lr05-dist2-1994": (1994, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=2"),
    "b05-ce20-lr05-dist3-1994": (1994, "ce", 20, 0.05, 0.0, None, "blocks=0-5", "dist=3"),
    "b05-ce20-lr05-dist3-1993": (1993, "ce", 20, 0.05, 0.0, None, "blocks=0-5", "dist=3"),
    "b05-ce20-lr05-dist3-1995": (1995, "ce", 20, 0.05, 0.0, None, "blocks=0-5", "dist=3"),
    # ninth round: the same on the Caltech-101 photos (``photo``: the bundles' photos, not their sketches)
    "frozen-photo-1993": (1993, "ce", 0, 0.0, 0.0, None, "photo"),
    "frozen-photo-1994": (1994, "ce", 0, 0.0, 0.0, None, "photo"),
    "frozen-photo-1995": (1995, "ce", 0, 0.0, 0.0, None, "photo"),
    "b05-ce10-lr05-dist3-photo-1993": (1993, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=3", "photo"),
    "b05-ce10-lr05-dist3-photo-1994": (1994, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=3", "photo"),
    "b05-ce10-lr05-dist3-photo-1995": (1995, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=3", "photo"),
    # tenth round: a first stage of 2 classes (``B2``)
    "frozen-photo-b2-1993": (1993, "ce", 0, 0.0, 0.0, None, "photo", *B2),
    "b05-ce10-lr05-dist3-photo-b2-1993": (1993, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=3", "photo", *B2),
    "frozen-photo-b2-1994": (1994, "ce", 0, 0.0, 0.0, None, "photo", *B2),
    "b05-ce10-lr05-dist3-photo-b2-1994": (1994, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=3", "photo", *B2),
    "frozen-photo-b2-1995": (1995, "ce", 0, 0.0, 0.0, None, "photo", *B2),
    "b05-ce10-lr05-dist3-photo-b2-1995": (1995, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=3", "photo", *B2),
    "frozen-b2-1993": (1993, "ce", 0, 0.0, 0.0, None, *B2),
    "b05-ce10-lr05-dist3-b2-1993": (1993, "ce", 10, 0.05, 0.0, None, "blocks=0-5", "dist=3", *B2),
}
OLD_MEANS: list[torch.Tensor] = []  # ``seen``: the earlier classes' mean features, each from its own stage


class Distilled(Adapted):
    """``dist=w``: with a ``teacher`` (the stage's adapters as they were when it began), forward_train
    also gives the teacher's read tokens (class token and 2 x 2 layout) and the student's, for
    ``distilled_loss``; without one, it is ``Adapted``'s."""

    teacher = None  # (weight, a frozen copy of the adapters)

    def forward_train(self, images):
        if self.teacher is None:
            return super().forward_train(images)
        weight, teacher = self.teacher
        stage = self.stages[-1]
        tokens = self.read(images, dropout=self.cfg.dropout if stage.training else 0.0)  # as EaseNetwork._run
        return (weight, self.embed(images, [teacher]), tokens), tokens[:, 0]


def distilled_loss(base):
    def loss(logits, targets, feats, ptm_feats, cfg):
        if not isinstance(ptm_feats, tuple):
            return base(logits, targets, feats, ptm_feats, cfg)
        weight, target, tokens = ptm_feats
        drift = (tokens - target).pow(2).sum(-1) / target.pow(2).sum(-1)
        return base(logits, targets, feats, None, cfg) + weight * drift.mean()

    return loss


def with_earlier_classes(make_classifier):
    """The stage's cosine classifier over the earlier classes and its own: the earlier rows are their
    stored class means and never move (their gradient is zeroed), the new rows start at the new
    classes' means (``head_init prototypes``). The earlier classes then act as negatives."""

    def make(network, images, cfg, data_config, **kw):
        classifier = make_classifier(network, images, cfg, data_config, **kw)
        if OLD_MEANS:
            old = torch.cat(OLD_MEANS).to(classifier.weight.device)
            classifier.weight.data[: len(old)] = old
            classifier.weight.register_hook(lambda g: torch.cat([torch.zeros_like(g[: len(old)]), g[len(old) :]]))
        return classifier

    return make


@torch.no_grad()
def adapter_moments(net, rels: list[str], sketches: Path, cfg, workers: int, device):
    """Σ xᵀx of every token entering each block's adapter (12, d, d) and Σ hᵀh of its hidden units
    (12, r, r), over these images (evaluation view): class-free statistics a run can keep."""
    stage, ptm = net.stages[-1], net.ptm
    d, r = stage.down.shape[1:]
    c_in = torch.zeros(len(ptm.blocks), d, d, dtype=torch.float64, device=device)
    c_h = torch.zeros(len(ptm.blocks), r, r, dtype=torch.float64, device=device)
    images = ImageSet(sketches, ("x",), tuple(sketches / "101_ObjectCategories" / q for q in rels), (0,) * len(rels))
    loader = torch.utils.data.DataLoader(ImageDataset(images, eval_transform(cfg)), batch_size=128, num_workers=workers)
    net.eval()
    for batch, _ in loader:
        x = backbone.embed_tokens(ptm, batch.to(device))
        for l, block in enumerate(ptm.blocks):
            x = x + block.ls1(block.attn(block.norm1(x)))
            hidden = torch.relu(x @ stage.down[l] + stage.down_bias[l])
            flat, flat_h = x.flatten(0, 1).double(), hidden.flatten(0, 1).double()
            c_in[l] += flat.T @ flat
            c_h[l] += flat_h.T @ flat_h
            x = x + block.ls2(block.mlp(block.norm2(x))) + net.cfg.scale * (hidden @ stage.up[l] + stage.up_bias[l])
    return c_in, c_h


def energy_projector(sums: torch.Tensor, energy: float) -> tuple[torch.Tensor, float]:
    """(B, n, n) projectors onto each matrix's leading eigenvectors that hold ``energy`` of its trace,
    and their mean rank."""
    values, vectors = torch.linalg.eigh(sums)
    values, vectors = values.flip(-1).clamp_min(0), vectors.flip(-1)
    share = values.cumsum(-1) / values.sum(-1, keepdim=True)
    keep = (share < energy).sum(-1) + 1  # the fewest leading directions that reach ``energy``
    mask = (torch.arange(sums.shape[-1], device=sums.device) < keep[:, None]).to(sums.dtype)
    return (vectors * mask[:, None, :]) @ vectors.transpose(1, 2), keep.float().mean().item()


def null_space(stage, projectors: dict) -> None:
    """Gradient hooks: once ``projectors`` holds "in" and "h" (an earlier stage's inputs to each
    adapter and its hidden units), Down learns only orthogonally to the inputs, Up only orthogonally
    to the hidden units, and the biases not at all, so the earlier images' adapter outputs stay
    (GPM / Adam-NSCL / InfLoRA's idea, here on AdaptFormer)."""
    gate = lambda g: g if "in" not in projectors else g * 0  # noqa: E731
    stage.down.register_hook(lambda g: g if "in" not in projectors else g - projectors["in"].to(g.dtype) @ g)
    stage.up.register_hook(lambda g: g if "h" not in projectors else g - projectors["h"].to(g.dtype) @ g)
    stage.down_bias.register_hook(gate)
    stage.up_bias.register_hook(gate)


def pack(args) -> None:
    """Two bundles: the train photos split in two (the DeiT-Tiny weights with the first), the manifest."""
    outs = [Path(p) for p in args.out.split(",")]
    caltech = args.shared / "caltech101" / "101_ObjectCategories"
    root = args.sketch / "101_ObjectCategories"
    rels = sorted(
        line for line in (args.sketch / "train.txt").read_text().split() if not line.startswith("BACKGROUND_Google")
    )
    manifest: dict = {"sha256": {}, "photo_sha256": {}, "orders": {}}
    for rel in rels:
        manifest["sha256"][rel] = hashlib.sha256((root / rel).read_bytes()).hexdigest()
        manifest["photo_sha256"][photo(rel)] = hashlib.sha256((caltech / photo(rel)).read_bytes()).hexdigest()
    for seed in (1993, 1994, 1995):
        data, stages = plan(args.sketch, seed, "val")
        manifest["orders"][seed] = {
            "stages": stages,
            "fit": {c: [str(Path(p).relative_to(root)) for p in data.train[c]] for c in data.train},
            "val": {c: [str(Path(p).relative_to(root)) for p in data.test[c]] for c in data.test},
        }
    sizes = [(caltech / photo(r)).stat().st_size for r in rels]
    half, total = sum(sizes) * args.first_share, 0
    for out in outs:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        shutil.copy(args.shared / "caltech101-sketch" / "make.py", out / "make.py")
    shutil.copy(
        args.shared / "deit_tiny_patch16_224" / "deit_tiny_patch16_224.safetensors", outs[0] / "weights.safetensors"
    )
    for rel, size in zip(rels, sizes):
        out = outs[0] if total < half else outs[1]
        total += size
        dst = out / "photos" / photo(rel)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(caltech / photo(rel), dst)
    (outs[1] / "manifest.json").write_text(json.dumps(manifest))
    for out in outs:
        mib = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
        print(f"{out}: {mib:.1f} MiB")


def photo(rel: str) -> str:
    """The Caltech-101 photo a sketch is drawn from (``a/b.png`` -> ``a/b.jpg``)."""
    return rel[:-4] + ".jpg"


def draw(args) -> None:
    """The sketches of one bundle's photos, by make.py's own ``sketch``, in parallel; the photos
    themselves beside them (``<dst>/../photo``), for the ``photo`` experiments."""
    spec = importlib.util.spec_from_file_location("make", args.src / "make.py")
    make = importlib.util.module_from_spec(spec)
    sys.modules["make"] = make  # the worker processes unpickle make.sketch by its module's name
    spec.loader.exec_module(make)
    photos = sorted((args.src / "photos").rglob("*.jpg"))
    jobs = [
        (p, args.dst / "101_ObjectCategories" / p.relative_to(args.src / "photos").with_suffix(".png")) for p in photos
    ]
    tick = time.time()
    with ProcessPoolExecutor() as ex:
        list(ex.map(make.sketch, jobs, chunksize=16))
    shutil.copytree(args.src / "photos", args.dst.parent / "photo" / "101_ObjectCategories", dirs_exist_ok=True)
    if (args.src / "weights.safetensors").is_file():
        shutil.copy(args.src / "weights.safetensors", args.dst.parent / "weights.safetensors")
    print(f"drew {len(jobs)} sketches from {args.src} in {time.time() - tick:.0f}s", flush=True)


def lists(args) -> None:
    """train.txt and test.txt beside both drawn trees, so the tool's own ``drl benchmark --val-fraction``
    reads them: the bundles hold the training images only, and a validation run never reads test.txt
    (it holds out part of train), so test.txt repeats train.txt. The sketches are checked first."""
    manifest = json.loads(args.manifest.read_text())
    check(manifest, args.sketches)
    check(manifest, args.photos, "photos")
    for images, rels in ((args.sketches, manifest["sha256"]), (args.photos, manifest["photo_sha256"])):
        text = "".join(f"{r}\n" for r in sorted(rels))
        for name in ("train.txt", "test.txt"):
            (images / name).write_text(text)
        print(f"{images}: {len(rels)} images listed", flush=True)


def check(manifest: dict, images: Path, kind: str = "sketches") -> None:
    root = images / "101_ObjectCategories"
    sums = manifest["sha256"] if kind == "sketches" else manifest["photo_sha256"]
    missing = [r for r in sums if not (root / r).is_file()]
    if missing:
        sys.exit(f"{len(missing)} {kind} missing (first {missing[0]}): was the first bundle drawn on this machine?")
    same = sum(hashlib.sha256((root / r).read_bytes()).hexdigest() == d for r, d in sums.items())
    print(f"{same} of {len(sums)} {kind} byte-identical to the manifest's", flush=True)


def images_of(images: Path, names: list[str], fit: dict) -> ImageSet:
    root = images / "101_ObjectCategories"
    paths = [root / p for c in names for p in fit[c]]
    labels = [i for i, c in enumerate(names) for _ in fit[c]]
    return ImageSet(images, tuple(names), tuple(paths), tuple(labels))


def embed(net, rels: list[str], images: Path, cfg, workers: int, device) -> torch.Tensor:
    return embed_images(net, [images / "101_ObjectCategories" / r for r in rels], cfg, workers, device)


def setup(args):
    """IEEE fp32 on the GPU, the sketches checked, the loader's workers kept between epochs, the PTM."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    manifest = json.loads(args.manifest.read_text())
    check(manifest, args.sketches)
    stage_train.make_loader = persistent(stage_train.make_loader)
    ptm = backbone.create_ptm("deit_tiny_patch16_224", source=PTMSource(weights_path=args.weights))
    return device, manifest, ptm, backbone.data_config(ptm)


def train(args) -> None:
    start = time.time()
    device, manifest, ptm, cfg = setup(args)
    rels = sorted(manifest["sha256"])[: args.max_images or None]
    args.out.mkdir(parents=True, exist_ok=True)
    adapters = {}
    for name in args.experiments.split(","):
        if time.time() - start > args.budget:
            print(f"budget spent: {name} and later not trained", flush=True)
            break
        kind, seed, loss, epochs, lr = EXPERIMENTS[name]
        order = manifest["orders"][str(seed)]
        fit = {c: ps[: args.max_per_class or None] for c, ps in order["fit"].items()}
        parts = [sorted(fit)] if kind == "joint" else order["stages"]
        net = Adapted(ptm, EaseConfig(adapter_dim=64))
        net.new_stage(seed=seed)
        net.to(device)
        tick, losses = time.time(), []
        for names in parts:
            config = TrainConfig(
                epochs=args.epochs or epochs,
                batch_size=48,
                lr=lr,
                loss=loss,
                kd_weight=0.0,
                seed=seed,
                num_workers=args.workers,
            )
            result = train_stage(net, images_of(args.sketches, names, fit), config, cfg)
            net.stages[-1].requires_grad_(True)  # train_stage freezes the stage it trained: carry it on
            losses.append(result.epoch_losses[-1])
        seconds = time.time() - tick
        adapters[name] = {k: v.detach().cpu() for k, v in net.stages[-1].state_dict().items()}
        torch.save(adapters, args.out / "adapters.pt")
        feats = embed(net, rels, args.sketches, cfg, args.workers, device)
        torch.save({"paths": rels, "features": feats}, args.out / f"{name}.pt")
        record = {"experiment": name, "seconds": seconds, "last_losses": losses, "embedded": len(rels)}
        with open(args.out / "train.jsonl", "a") as log:
            log.write(json.dumps(record) + "\n")
        print(
            f"{name}: trained {seconds:.0f}s, last losses {[round(x, 3) for x in losses]}, embedded {len(rels)}",
            flush=True,
        )
    print(f"done in {time.time() - start:.0f}s", flush=True)


def flag(flags: list[str], name: str, default):
    """The value of an experiment's ``name=value`` flag, or ``default``."""
    return next((f.partition("=")[2] for f in flags if f.startswith(name + "=")), default)


def staged(args) -> None:  # noqa: C901
    """Adapters carried from stage to stage (``blocks=``: only those blocks' adapters learn; ``null=ε``:
    after stage 1, only orthogonally to the earlier images' adapter inputs; ``dist=w``: after stage 1,
    w times the stage's images' relative squared move of the read tokens is added to the loss; ``photo``: on the
    Caltech-101 photos the sketches are drawn from, ``--photos``). The head is
    replayed here, on this machine's CPUs: with every statistic from the final network (the bound,
    ``../cov_rank/replay.py``), then as a run would, each stage's statistics from its own network and
    carried to the later ones by ``carry.py``'s ``--carries`` (stale: not moved)."""
    from replay import replay, summary_line  # noqa: PLC0415

    from drlcli.benchmark.protocol import BenchmarkData, stage_classes  # noqa: PLC0415
    from drlcli.config import RunConfig  # noqa: PLC0415

    start = time.time()
    device, manifest, ptm, cfg = setup(args)
    stage_train._classifier = with_earlier_classes(stage_train._classifier)
    stage_train.stage_loss = distilled_loss(stage_train.stage_loss)
    args.out.mkdir(parents=True, exist_ok=True)
    adapters, checked = {}, False  # checked: the photos, once
    for name in args.experiments.split(","):
        if time.time() - start > args.budget:
            print(f"budget spent: {name} and later not run", flush=True)
            break
        seed, loss, epochs, lr, kd, first, *flags = STAGED[name]
        seen_classes = "seen" in flags
        blocks = flag(flags, "blocks", "")
        energy = float(flag(flags, "null", 0))
        distill = float(flag(flags, "dist", 0))
        projectors: dict = {}
        moments = None
        OLD_MEANS.clear()
        order = manifest["orders"][str(seed)]
        cap = args.max_per_class or None
        on_photos = "photo" in flags
        named = photo if on_photos else str  # the photos a sketch is drawn from, or the sketch
        fit = {c: [named(p) for p in ps[:cap]] for c, ps in order["fit"].items()}
        val = {c: [named(p) for p in ps[:cap]] for c, ps in order["val"].items()}
        base = args.photos if on_photos else args.sketches
        if on_photos and not checked:
            check(manifest, base, "photos")
            checked = True
        root = base / "101_ObjectCategories"
        stages = order["stages"]
        inc = int(flag(flags, "inc", 0))
        if inc:  # B{inc} Inc{inc} over the same class order, its first ``stages=`` stages
            sequence = [c for names in stages for c in names]
            stages = stage_classes(sequence, inc, inc)
            stages = stages[: int(flag(flags, "stages", len(stages)))]
        stages = stages[: args.stages or None]
        data = BenchmarkData(
            {c: [root / p for p in ps] for c, ps in fit.items()},
            {c: [root / p for p in ps] for c, ps in val.items()},
            f"{'photo' if on_photos else 'sketch'}, validation split 0.2 of train",
        )
        net = Distilled(ptm, EaseConfig(adapter_dim=64))
        net.new_stage(seed=seed)
        net.to(device)
        if blocks:
            learn_only(net.stages[-1], blocks)
        if energy:
            null_space(net.stages[-1], projectors)
        tick, seen, train_s, snapshots, norms, ranks, drifts = time.time(), [], 0.0, [], [], [], []
        tables: dict = {"after": {}, "before": {}, "val": []}  # what a run sees, as ``carry.py embed`` writes it
        for k, names in enumerate(stages):
            stage_epochs, stage_lr = first if (k == 0 and first) else (epochs, lr)
            own = [p for c in sorted(names) for p in fit[c]]
            before = embed(net, own, base, cfg, args.workers, device).float()  # what the map is fitted from
            tables["before"].update(zip([str(root / r) for r in own], before))
            if stage_epochs:
                config = TrainConfig(
                    epochs=args.epochs or stage_epochs,
                    batch_size=48,
                    lr=stage_lr,
                    loss=loss,
                    kd_weight=kd,
                    seed=seed,
                    num_workers=args.workers,
                    weight_decay=0.0 if (energy and projectors) else TrainConfig().weight_decay,
                )
                images = images_of(base, sorted(names), fit)
                if seen_classes:
                    config = replace(config, head_init="prototypes")
                    images = ImageSet(
                        images.root,
                        tuple(seen) + images.class_names,
                        images.paths,
                        tuple(label + len(seen) for label in images.labels),
                    )
                if distill and k:
                    teacher = copy.deepcopy(net.stages[-1]).requires_grad_(False).eval()
                    net.teacher = (distill, teacher)
                t0 = time.time()
                train_stage(net, images, config, cfg)
                net.teacher = None
                net.stages[-1].requires_grad_(True)  # train_stage freezes the stage it trained: carry it on
                train_s += time.time() - t0
                if energy:  # the stage's images through its trained adapters join the protected inputs
                    c_in, c_h = adapter_moments(net, own, base, cfg, args.workers, device)
                    moments = (c_in, c_h) if moments is None else (moments[0] + c_in, moments[1] + c_h)
                    (projectors["in"], rank_in), (projectors["h"], rank_h) = (
                        energy_projector(m, energy) for m in moments
                    )
                    ranks.append((round(rank_in, 1), round(rank_h, 1)))
                if seen_classes:
                    new = images_of(base, sorted(names), fit)
                    OLD_MEANS.append(initial_class_means(net, new, cfg, batch_size=64, num_workers=args.workers))
                    net.stages[-1].train()
            snapshots.append({k: v.detach().cpu().half() for k, v in net.stages[-1].state_dict().items()})
            norms.append(round(net.stages[-1].up.detach().norm().item(), 4))
            seen += sorted(names)
            rels = own + [p for c in seen for p in val[c]]
            feats = embed(net, rels, base, cfg, args.workers, device).float()
            keys = [str(root / r) for r in rels]
            tables["after"].update(zip(keys[: len(own)], feats[: len(own)]))
            moved = (feats[: len(own)] - before).pow(2).sum((1, 2)) / before.pow(2).sum((1, 2))
            drifts.append(float(f"{moved.mean().item():.3g}"))  # the stage's own images, relative squared move
            tables["val"].append(dict(zip(keys[len(own) :], feats[len(own) :])))
        rels = sorted({p for part in (fit, val) for c in seen for p in part[c]})
        final = dict(zip([str(root / r) for r in rels], embed(net, rels, base, cfg, args.workers, device).float()))
        adapters[name] = {k: v.detach().cpu() for k, v in net.stages[-1].state_dict().items()}
        torch.save(adapters, args.out / "staged-adapters.pt")
        torch.save(snapshots, args.out / f"{name}-stages.pt")  # every stage's adapters (float16), for carry.py
        config = RunConfig.for_method("drl", {"ranpac": {"covariance_rank": 0}}, preset="frozen").with_train(seed=seed)
        if args.save_tables:
            torch.save(tables, args.out / f"{name}-tables.pt")
        carries = [Carry(kind, lam=args.carry_lam) for kind in args.carries.split(",") if kind]
        for stats in ["final"] + carries:  # the bound (every statistic from the final network), then a run's
            if stats == "final":
                result = replay(data, stages, final, config, [16])[16]
            else:
                result, stats = replay_carried(tables, data, stages, config, stats), stats.label
            record = {
                "experiment": name,
                "statistics": stats,
                "train_s": train_s,
                "s": time.time() - tick,
                "up_norms": norms,
                "protected_ranks": ranks,
                "drifts": drifts,
                **result,
            }
            with open(args.out / "staged.jsonl", "a") as log:
                log.write(json.dumps(record) + "\n")
            print(
                f"{name} [{stats}]: {summary_line(result)} (train {train_s:.0f}s, {time.time() - tick:.0f}s, |Up| {norms[-1]})",
                flush=True,
            )
    print(f"done in {time.time() - start:.0f}s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    k = sub.add_parser("pack")
    k.add_argument("--sketch", type=Path, required=True)
    k.add_argument("--shared", type=Path, default=Path("../shared/data"))
    k.add_argument("--out", default=".devA,.devB")
    k.add_argument("--first-share", type=float, default=0.45, help="of the photos' bytes, in the first bundle")
    d = sub.add_parser("draw")
    d.add_argument("--src", type=Path, required=True)
    d.add_argument("--dst", type=Path, default=Path("/tmp/sketch"))
    lst = sub.add_parser("lists")
    lst.add_argument("--manifest", type=Path, required=True)
    lst.add_argument("--sketches", type=Path, default=Path("/tmp/sketch"))
    lst.add_argument("--photos", type=Path, default=Path("/tmp/photo"))
    t = sub.add_parser("train")
    t.add_argument("--experiments", default=",".join(EXPERIMENTS))
    t.add_argument("--max-images", type=int, default=0, help="a smoke test: embed the first N images")
    t.add_argument("--max-per-class", type=int, default=0, help="a smoke test: train on N images a class")
    g = sub.add_parser("staged")
    g.add_argument("--experiments", default=",".join(STAGED))
    g.add_argument("--max-per-class", type=int, default=0, help="a smoke test: N fit and val images a class")
    g.add_argument("--stages", type=int, default=0, help="a smoke test: the first N stages")
    g.add_argument("--carries", default="stale,rows", help="carry.py's carries replayed (stale: what a run does now)")
    g.add_argument("--carry-lam", type=float, default=1000.0, help="their per-token ridge map's λ")
    g.add_argument(
        "--save-tables", action="store_true", help="write each run's tables for carry.py replay (fp16, 29 MB)"
    )
    for q in (t, g):
        q.add_argument("--manifest", type=Path, required=True)
        q.add_argument("--weights", type=Path, required=True)
        q.add_argument("--sketches", type=Path, default=Path("/tmp/sketch"))
        q.add_argument("--photos", type=Path, default=Path("/tmp/photo"), help="for the photo experiments")
        q.add_argument("--out", type=Path, required=True)
        q.add_argument("--budget", type=float, default=330.0, help="seconds; no new experiment starts after")
        q.add_argument("--workers", type=int, default=14)
        q.add_argument("--epochs", type=int, default=0, help="a smoke test: this many epochs everywhere")
    args = parser.parse_args()
    {"pack": pack, "draw": draw, "lists": lists, "train": train, "staged": staged}[args.command](args)


if __name__ == "__main__":
    main()
