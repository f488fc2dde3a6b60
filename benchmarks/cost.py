"""Inference and training cost of drl and ease, as ratios to one bare forward of the same PTM.

    python benchmarks/cost.py                                   # ViT-B/16 and DeiT-Tiny, CPU, batch 32
    python benchmarks/cost.py --archs deit_tiny_patch16_224 --repeats 3 --no-memory --no-disk
    python benchmarks/cost.py --device cuda --bf16              # on a GPU: fp32 and bf16 autocast

Random weights of real architectures (timm, no download). Every case is timed in the same process,
interleaved round by round with the bare forward, and reported as median time / median bare time:
- inference: ``drl`` with T stages scored as the paper does (``--preset paper``: one pass over
  every subspace, prototype scoring included), the default ``drl`` with T stages (``drl_default``:
  the ridge + class-covariance head, which reads f_0 alone, so no stage stream is computed; the
  head's M 3000 projection and C·d² Mahalanobis work included) and ``ease`` with T stages (one ViT
  pass per stage), against ``ptm.forward_features`` under ``torch.inference_mode``;
- inference of ``ranpac`` (``ranpac_T10``: the bare PTM pass and RanPAC's ridge head on f_0, M 3000,
  100 classes), of RanPAC as published (``ranpac_published_T10``: the PTM with stage 1's
  AdaptFormer adapters, the same head) and of ``ranpac --preset carried`` (``ranpac_carried_T10``:
  the PTM with its one adapter set in the leading half of the blocks, the default ``drl``'s head);
- one training step of a new stage (forward, loss, backward, SGD step; the real ``train.py`` step)
  at stage 1 and stage 10, against one bare frozen forward (``torch.no_grad``) of the same batch;
- peak memory of each case (CPU: the rise of the process's peak RSS, each case in a fresh process;
  CUDA: ``max_memory_allocated``), and the activations kept for backward by a training step;
- bytes on disk per stage in a real run directory (``learn-stage`` on generated images).
Times are the fastest of ``--repeats`` calls (other load on a shared machine only adds time; the
medians are in the JSON). Prints tables of ratios; ``--json FILE`` also writes every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import timm
import torch

from drlcli.config import RunConfig
from drlcli.heads.ridge.head import RidgeHead
from drlcli.methods import METHODS
from drlcli.model.incremental import IncrementalModel
from drlcli.options import ScoreConfig
from drlcli.stage.train import CosineClassifier, _StageStep

CLASSES_PER_STAGE = 10


def build_ptm(arch: str, device: torch.device, kwargs: dict | None = None) -> torch.nn.Module:
    ptm = timm.create_model(arch, pretrained=False, num_classes=0, **(kwargs or {})).to(device).eval()
    ptm.requires_grad_(False)
    return ptm


def build_network(method: str, ptm: torch.nn.Module, stages: int, preset: str | None = None) -> torch.nn.Module:
    """A network with ``stages`` frozen stages whose parameters are random (not the zero init)."""
    network = METHODS[method].build(ptm, RunConfig.for_method(method, preset=preset))
    generator = torch.Generator().manual_seed(0)
    for s in range(stages):
        stage = network.new_stage(seed=s)
        with torch.no_grad():
            for p in stage.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=generator).to(p))
        stage.eval().requires_grad_(False)
    return network


def classifier_model(method: str, network: torch.nn.Module) -> IncrementalModel:
    """``method``'s ``network`` with random prototypes for CLASSES_PER_STAGE classes per stage: full inference."""
    offset = METHODS[method].offset
    stages = network.num_stages
    num_classes = max(stages, 1) * CLASSES_PER_STAGE
    class_stage = torch.arange(num_classes) // CLASSES_PER_STAGE + 1
    protos = torch.randn(num_classes, offset + stages, network.width)
    for c in range(num_classes):  # real prototypes only where the class's stage has a subspace
        protos[c, offset + int(class_stage[c]) :] = 0
    model = IncrementalModel(network, [str(c) for c in range(num_classes)], class_stage, protos, ScoreConfig(), {})
    model.offset = offset
    return model


def with_default_head(model: IncrementalModel, method: str = "drl", preset: str | None = None) -> IncrementalModel:
    """``model`` scored as ``method``'s new run (with ``preset``) scores with the ridge head: the
    default ``drl``'s, ridge on ReLU([f_0, PTM layout] R) (M and the layout grid from the config) plus
    class covariances; ``ranpac``'s, the ridge on f_0 alone. Random tensors of the real shapes."""
    cfg = RunConfig.for_method(method, preset=preset).ridge
    g = torch.Generator().manual_seed(1)
    d, num_classes = model.network.width, len(model.class_names)
    proj_dim = cfg.resolved_proj_dim(d)
    a = torch.randn(num_classes, d, d, generator=g) / d**0.5
    covariances = cfg.covariance_weight > 0
    model.head = RidgeHead(
        torch.randn(d * (1 + cfg.layout_grid**2), proj_dim, generator=g),
        torch.randn(proj_dim, num_classes, generator=g),
        torch.randn(num_classes, d, generator=g) if covariances else None,
        a @ a.transpose(1, 2) + torch.eye(d) if covariances else None,
        torch.tensor(cfg.covariance_weight) if covariances else None,
        layout=cfg.layout_grid,
    ).to(next(model.network.parameters()).device)
    return model


def inference_case(model: IncrementalModel, images: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        with torch.inference_mode():
            model.score_images(images)

    model.prototype_bank()  # synthesised once, as a loaded run does
    return run


def train_case(method: str, ptm: torch.nn.Module, stage: int, images: torch.Tensor) -> Callable[[], None]:
    """One optimisation step of stage ``stage`` (stage - 1 frozen stages before it)."""
    network = build_network(method, ptm, stage - 1)
    new = network.new_stage(seed=stage)
    new.train()
    cfg = RunConfig.for_method(method).train  # the step uses the method's loss, distillation and σ init
    classifier = CosineClassifier(network.width, CLASSES_PER_STAGE, scale_init=cfg.scale_init).to(images.device)
    step = _StageStep(network, classifier, cfg)
    params = [p for p in new.parameters() if p.requires_grad] + list(classifier.parameters())
    optimizer = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    targets = torch.arange(len(images), device=images.device) % CLASSES_PER_STAGE

    def run() -> None:
        loss = step(images, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    run.module = step  # type: ignore[attr-defined]
    return run


def saved_activation_bytes(fn: Callable[[], None], module: torch.nn.Module) -> int:
    """Bytes of the activations autograd keeps for backward during one call: distinct storages,
    ``module``'s parameters (frozen or not) excluded."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_cases(
    cases: dict[str, Callable[[], None]], *, repeats: int, device: torch.device, log
) -> dict[str, list[float]]:
    """Seconds of every call per case; cases run interleaved, after one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(repeats + 1):
        for name, fn in cases.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            if round_:
                times[name].append(time.perf_counter() - start)
        log(f"  round {round_}/{repeats} done")
    return times


def cases_for(arch: str, args, device: torch.device, which: str | None = None) -> dict[str, Callable[[], None]]:
    """Every case for ``arch`` (or only ``which``), sharing one PTM."""
    ptm = build_ptm(arch, device, args.ptm_kwargs)
    size = ptm.patch_embed.img_size
    batch = args.memory_batch if which and which.startswith("train") else args.batch
    images = torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(0)).to(device)
    cases: dict[str, Callable[[], None]] = {}

    def want(name: str) -> bool:
        return which is None or which == name

    if want("bare"):

        def bare() -> None:
            with torch.inference_mode():
                ptm.forward_features(images)

        cases["bare"] = bare
    if want("bare_no_grad"):

        def bare_no_grad() -> None:
            with torch.no_grad():
                ptm.forward_features(images)

        cases["bare_no_grad"] = bare_no_grad
    inference = [
        (f"{m}_T{t}", m, t, False) for m, counts in (("drl", args.stages), ("ease", args.ease_stages)) for t in counts
    ]
    inference += [(f"drl_default_T{t}", "drl", t, True) for t in args.default_stages]
    for name, method, t, default_head in inference:
        if want(name):
            model = classifier_model(method, build_network(method, ptm, t))
            cases[name] = inference_case(with_default_head(model) if default_head else model, images)
    if args.ranpac:
        cases.update(ranpac_cases(ptm, images, want))
    for s in args.train_stages:
        for method in ("drl", "ease"):
            if want(f"train_{method}_s{s}") and (method == "drl" or s in args.ease_train_stages):
                cases[f"train_{method}_s{s}"] = train_case(method, ptm, s, images)
    return cases


def ranpac_cases(
    ptm: torch.nn.Module, images: torch.Tensor, want: Callable[[str], bool]
) -> dict[str, Callable[[], None]]:
    """RanPAC: the bare PTM pass, or (published) the PTM with stage 1's AdaptFormer adapters, with the
    ridge head on f_0; or (carried) the PTM with the carried set, with the default ``drl``'s head;
    over 10 stages of classes."""
    cases = {}
    presets = (("ranpac_T10", None), ("ranpac_published_T10", "published"), ("ranpac_carried_T10", "carried"))
    for name, preset in presets:
        if want(name):
            network = build_network("ranpac", ptm, 1 if preset else 0, preset)
            num_classes = 10 * CLASSES_PER_STAGE
            protos = torch.randn(num_classes, network.num_subspaces, network.width)
            names = [str(c) for c in range(num_classes)]
            model = IncrementalModel(
                network, names, torch.ones(num_classes, dtype=torch.long), protos, ScoreConfig(), {}
            )
            cases[name] = inference_case(with_default_head(model, "ranpac", preset), images)
    return cases


def autocast(device: torch.device, bf16: bool):
    if bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _peak_rss() -> int:
    """Peak resident memory of this process in bytes (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak restarts from the current RSS


def measure_memory_case(arch: str, case: str, args) -> dict[str, float]:
    """Run in a fresh process: peak memory of one call of ``case`` above the loaded state."""
    device = torch.device(args.device)
    args.stages, args.ease_stages, args.train_stages, args.ease_train_stages = [10], [10], [1, 10], [10]
    cases = cases_for(arch, args, device, which=case)
    fn = cases[case]
    with autocast(device, args.bf16):
        if device.type == "cuda":
            fn()  # warm-up: cuBLAS workspaces and lazily built kernels are not the case's memory
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            fn()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            base = Path("/proc/self/statm").read_text().split()[1]
            _reset_peak_rss()
            base = int(base) * resource.getpagesize()
            fn()
            peak = _peak_rss() - base
        saved = saved_activation_bytes(fn, fn.module) if case.startswith("train") else 0
    return {"peak_bytes": peak, "saved_activation_bytes": saved}


def memory(arch: str, names: list[str], args, log) -> dict[str, dict[str, float]]:
    out = {}
    for name in names:
        command = [sys.executable, __file__, "--_memory-case", f"{arch}:{name}", "--device", args.device]
        command += [
            "--batch",
            str(args.batch),
            "--memory-batch",
            str(args.memory_batch),
            "--threads",
            str(args.threads),
        ]
        command += ["--bf16"] if args.bf16 else []
        command += ["--ptm-kwargs", json.dumps(args.ptm_kwargs)] if args.ptm_kwargs else []
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode:
            raise SystemExit(f"memory case {name} failed:\n{result.stderr}")
        out[name] = json.loads(result.stdout.strip().splitlines()[-1])
        log(f"  memory {name}: {out[name]['peak_bytes'] / 2**20:.0f} MiB")
    return out


def disk_bytes(arch: str, args, log) -> dict[str, int]:
    """Bytes of each stage's committed files in a real run directory (random-init PTM), drl's
    ``paper`` preset: adapters and prototypes (the default ridge head adds its statistics,
    ``statistics.safetensors``, 4·M(M+1) bytes per stage: about 36 MB at M 3000)."""
    from drlcli import api
    from drlcli.run.directory import RunDir
    from drlcli.run.layout import stage_dir
    from drlcli.synthetic import make_class_folders

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        config = RunConfig.for_method("drl", preset="paper")
        api.init_run(run, ptm=arch, random_init=True, ptm_kwargs=args.ptm_kwargs, config=config)
        sizes = {}
        for s in range(1, args.disk_stages + 1):
            ids = list(range((s - 1) * args.disk_classes, s * args.disk_classes))
            data = make_class_folders(Path(tmp) / f"stage{s}", ids, images_per_class=1, size=32)
            api.learn_stage(
                run, data_dir=data, train_overrides={"epochs": 1, "batch_size": args.disk_classes}, device=args.device
            )
            sizes[f"stage_{s}"] = RunDir(run).size_bytes(prefix=stage_dir(s) + "/")
            log(f"  disk stage {s}: {sizes[f'stage_{s}'] / 2**20:.2f} MiB")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archs", default="vit_base_patch16_224,deit_tiny_patch16_224")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--stages", default="1,5,10,20", help="drl inference stage counts")
    parser.add_argument("--default-stages", default="10,20", help="default drl (ridge + covariance head) stage counts")
    parser.add_argument("--ease-stages", default="10", help="ease inference stage counts")
    parser.add_argument("--no-ranpac", dest="ranpac", action="store_false", help="leave out ranpac and its presets")
    parser.add_argument("--train-stages", default="1,10")
    parser.add_argument("--ease-train-stages", default="10")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="also time under bf16 autocast (CUDA)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--memory-batch", type=int, default=48, help="batch of the training memory cases")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-disk", action="store_true")
    parser.add_argument("--disk-stages", type=int, default=2)
    parser.add_argument("--disk-classes", type=int, default=20)
    parser.add_argument("--ptm-kwargs", type=json.loads, default=None, help="timm.create_model options (JSON)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--_memory-case", dest="memory_case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.stages = [int(t) for t in args.stages.split(",") if t]
    args.ease_stages = [int(t) for t in args.ease_stages.split(",") if t]
    args.default_stages = [int(t) for t in args.default_stages.split(",") if t]
    args.train_stages = [int(t) for t in args.train_stages.split(",") if t]
    args.ease_train_stages = [int(t) for t in args.ease_train_stages.split(",") if t]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_case:
        arch, case = args.memory_case.split(":")
        print(json.dumps(measure_memory_case(arch, case, args)))
        return

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    device = torch.device(args.device)
    report = {
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        },
        "batch": args.batch,
        "archs": {},
    }
    for arch in args.archs.split(","):
        log(f"{arch}: timing")
        cases = cases_for(arch, args, device)
        entry = {}
        for precision in ["fp32"] + (["bf16"] if args.bf16 else []):
            with autocast(device, precision == "bf16"):
                times = time_cases(cases, repeats=args.repeats, device=device, log=log)
            # the fastest call of each case: on a shared machine, other load only ever adds time
            seconds = {name: min(t) for name, t in times.items()}
            entry[precision] = {
                "seconds": seconds,
                "median_seconds": {name: statistics.median(t) for name, t in times.items()},
                "ratio": {
                    name: seconds[name] / seconds["bare" if not name.startswith("train") else "bare_no_grad"]
                    for name in seconds
                },
                "images_per_second": {name: args.batch / s for name, s in seconds.items()},
            }
        del cases
        if not args.no_memory:
            names = ["bare", "drl_T10", "ease_T10", "train_drl_s1", "train_drl_s10", "train_ease_s10"]
            entry["memory"] = memory(arch, names, args, log)
        if not args.no_disk:
            entry["disk"] = disk_bytes(arch, args, log)
        report["archs"][arch] = entry
        print_tables(arch, entry, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


def print_tables(arch: str, entry: dict, args) -> None:
    print(f"\n## {arch}, batch {args.batch}, {args.device}")
    for precision in ("fp32", "bf16"):
        if precision not in entry:
            continue
        e = entry[precision]
        print(f"\n{precision}: time / bare (inference: forward_features; training: frozen forward)")
        print("| case | ms | ratio | images/s |")
        print("|---|---|---|---|")
        for name, s in e["seconds"].items():
            print(f"| {name} | {s * 1000:.0f} | {e['ratio'][name]:.2f} | {e['images_per_second'][name]:.1f} |")
        ease, drl = e["seconds"].get("ease_T10"), e["seconds"].get("drl_T10")
        if ease and drl:
            print(f"\nease T=10 / drl T=10: {ease / drl:.2f}x")
    if "memory" in entry:
        print(f"\npeak memory above the loaded model (training cases at batch {args.memory_batch})")
        print("| case | peak MiB | kept for backward MiB |")
        print("|---|---|---|")
        for name, m in entry["memory"].items():
            print(f"| {name} | {m['peak_bytes'] / 2**20:.0f} | {m['saved_activation_bytes'] / 2**20:.0f} |")
    if "disk" in entry:
        print("\nrun-directory bytes per stage (" + f"{args.disk_classes} classes per stage)")
        for name, b in entry["disk"].items():
            print(f"- {name}: {b / 2**20:.2f} MiB ({b} bytes)")


if __name__ == "__main__":
    main()
