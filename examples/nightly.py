"""Nightly "new classes arrived" pipeline through the Python API (the same steps as nightly.sh).

    python examples/nightly.py [DROPS_DIR] [WORK_DIR]

Run it as a script, or cell by cell (``# %%``) in a notebook or an editor. DROPS_DIR holds one
folder per data drop, learned in name order: ``DROP/train/<class>/...`` (new classes only) and
optionally ``DROP/test/<class>/...``. Without DROPS_DIR the built-in offline default is used:
two generated drops and a tiny random ViT. With DROPS_DIR, the PTM is ``$PTM`` (default
deit_tiny_patch16_224) with weights from ``$DRL_PTM_WEIGHTS``.
"""

# %% Settings
import json
import os
import sys
from pathlib import Path

import drlcli
from drlcli.commands.predict import predict
from drlcli.errors import DrlError, RunStateError
from drlcli.synthetic import TINY_PTM, TINY_PTM_KWARGS, make_stages

args = [a for a in sys.argv[1:] if not a.startswith("-")]  # notebooks pass their own flags
drops_dir = Path(args[0]) if args and args[0] else None
work = Path(args[1] if len(args) > 1 else "nightly-py")
run_dir = work / "run"
device = os.environ.get("DEVICE", "auto")
formats = os.environ.get("FORMATS", "drl torchscript").split()
offline = drops_dir is None
if offline:  # the offline default: generated drops (once), a tiny random ViT
    drops_dir = work / "drops"
    if not drops_dir.is_dir():
        make_stages(drops_dir, num_stages=2, classes_per_stage=3, train=12, test=4, name="drop{:03d}")
epochs = int(os.environ.get("EPOCHS", 2 if offline else 20))
(work / "models").mkdir(parents=True, exist_ok=True)

# %% 1. Once: create the run
try:
    info = drlcli.info(run_dir)
except RunStateError:  # not a run directory yet (any other DrlError stops the pipeline)
    if offline:
        drlcli.init_run(run_dir, ptm=TINY_PTM, random_init=True, ptm_kwargs=TINY_PTM_KWARGS)
    else:
        weights = os.environ.get("DRL_PTM_WEIGHTS")
        drlcli.init_run(
            run_dir, ptm=os.environ.get("PTM", "deit_tiny_patch16_224"), ptm_weights=Path(weights) if weights else None
        )
    info = drlcli.info(run_dir)
learned = {c for stage in info["stages"] for c in stage["classes"]}
print(f"run {run_dir}: {info['num_stages']} stages, {info['num_classes']} classes")

# %% 2. Learn each new drop, in name order
for drop in sorted(p for p in drops_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
    classes = {p.name for p in (drop / "train").iterdir() if p.is_dir()}
    if classes <= learned:
        continue  # learned on an earlier night
    test_dir = drop / "test"
    result = drlcli.learn_stage(
        run_dir,
        data_dir=drop / "train",
        eval_data_dir=test_dir if test_dir.is_dir() else None,
        train_overrides={"epochs": epochs},
        device=device,
    )
    top1 = f", top-1 on all seen {result.eval.top1:.2f}%" if result.eval else ""
    print(f"drop {drop.name} -> stage {result.stage}: {len(result.classes)} classes {result.status}{top1}")
    learned |= classes

# %% 3. Evaluate every registered test set: accuracy matrix, forgetting, confusions
try:
    evaluation = drlcli.evaluate(run_dir, all_seen=True, device=device)
    history = evaluation.history
    print(f"top-1 {evaluation.report.top1:.2f}%, Ā {history.average}, mean forgetting {history.mean_forgetting}")
    for t, row in enumerate(history.matrix, 1):
        print(f"  after stage {t}: " + "  ".join("-" if v is None else f"{v:.1f}" for v in row))
    print("most confused:", evaluation.confused[:3])
except DrlError as exc:  # e.g. no drop had test data
    print(f"no evaluation: {exc}")

# %% 4. Export for serving, named by the run's generation
generation = drlcli.info(run_dir)["generation"]
suffix = {"drl": "drl", "torchscript": "pt", "onnx": "onnx"}
exported = {}
for fmt in formats:
    path = work / "models" / f"model-g{generation}.{suffix[fmt]}"
    if not path.is_file():
        drlcli.export_run(run_dir, path, fmt=fmt)
    exported[fmt] = path
print("exported:", {fmt: str(p) for fmt, p in exported.items()})

# %% 5. Smoke test: predict a few images of the newest drop with each exported file
newest = sorted(p for p in drops_dir.iterdir() if p.is_dir())[-1]
images = sorted(p for p in newest.rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))[:4]
for fmt, path in exported.items():
    # TorchScript runs code from the file: opt in only for the file exported just above
    model = drlcli.load_model(path, trust_code=fmt == "torchscript")
    for prediction in predict(model, images, top_k=3):
        print(fmt, json.dumps(prediction.to_dict()))
