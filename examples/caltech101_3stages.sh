#!/usr/bin/env bash
# Real-data check: DeiT-Tiny (ImageNet-1k) on the first 30 Caltech-101 classes (sorted),
# three stages of 10 classes, for a method (drl by default, or simplecil), on CPU.
#
#   bash examples/caltech101_3stages.sh [METHOD] [EPOCHS] [WORK_DIR]
#
# Needs ../shared/data (the DeiT-Tiny safetensors and Caltech-101 with its train/test lists).
set -euo pipefail
method=${1:-drl}
epochs=${2:-5}
work=${3:-/tmp/drl-caltech30}
data=${DRL_SHARED_DATA:-$(cd "$(dirname "$0")/../.." && pwd)/shared/data}
weights=$data/deit_tiny_patch16_224/deit_tiny_patch16_224.safetensors

python "$(dirname "$0")/caltech101_stages.py" --caltech "$data/caltech101" --out "$work/stages" \
    --num-classes 30 --per-stage 10 >/dev/null
run=$work/run-$method
rm -rf "$run"
drl init --run "$run" --ptm deit_tiny_patch16_224 --ptm-weights "$weights" --method "$method"
for k in 1 2 3; do
    drl learn-stage --run "$run" --data "$work/stages/stage$k/train" \
        --eval-data "$work/stages/stage$k/test" --epochs "$epochs" --device cpu --json \
        > "$work/$method-stage$k.json"
    python -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"stage {r['stage']}: A_{r['stage']} {r['eval']['top1']:.2f}  wall {r['total_seconds']:.0f}s (train {r['train_seconds']:.0f}s)\")" "$work/$method-stage$k.json"
done
drl eval --run "$run" --all-seen --device cpu
