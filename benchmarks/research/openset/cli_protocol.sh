#!/usr/bin/env bash
# Issue 19's protocol through the CLI: learn stages 1-9 of a `drl benchmark` layout (its data/ folder,
# test capped as the benchmark wrote it), then `drl eval` with the test images of stages 10-11 as the
# unknown classes.
#
#   cli_protocol.sh LAYOUT OUT WEIGHTS [METHOD]     # e.g. BENCH/seed_1993/data runs/cal W.safetensors ranpac
#
# The run uses the method's defaults (open_set.rule rmd); OUT/eval.json holds `drl eval --json`.
set -euo pipefail
layout=$1 out=$2 weights=$3 method=${4:-drl}
mkdir -p "$out/known" "$out/unknown"
drl init --run "$out/run" --ptm deit_tiny_patch16_224 --ptm-weights "$weights" --method "$method"
for s in 01 02 03 04 05 06 07 08 09; do
    drl learn-stage --run "$out/run" --data "$layout/stage_$s/train" --epochs 1
    cp -r "$layout/stage_$s/test/." "$out/known/"
done
for s in 10 11; do cp -r "$layout/stage_$s/test/." "$out/unknown/"; done
drl eval --run "$out/run" --data "$out/known" --unknown-data "$out/unknown" --json > "$out/eval.json"
drl eval --run "$out/run" --data "$out/known" --unknown-data "$out/unknown"
