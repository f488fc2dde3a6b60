#!/usr/bin/env bash
# Issue 32 on a lent GPU: the tool's own `drl benchmark`, sketches and photos, orders 1993-1995, B0 Inc10,
# validation split, the default `drl` (the switched schedule) against the frozen head (`drl/preset=frozen`) and RanPAC as published, side by side.
#
# The training photos travel in two bundles (`gpu_oracle.py pack`, 64 MiB a call) and the sketches
# are redrawn there by the data set's own make.py, checked against the sha256 of the sketches here:
#   device call 1, carry [".devA"] (timeout_s 200; the CUDA tests too, issue 18):
#     python3 benchmarks/research/adapt/gpu_oracle.py draw --src .devA --dst /tmp/sketch; set -o pipefail;
#     HF_HUB_OFFLINE=1 PYTHONPATH=. timeout 120 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
#       --junitxml $OUT/gpu.xml 2>&1 | tee $OUT/gpu-tests.log
#   device call 2 at once, on the same warm machine, carry [".devB"] (timeout_s 560; LIMIT: the device
#   time left after call 1 less about 90 s, at most 500), then give_back:
#     bash benchmarks/research/adapt/gpu_bench.sh LIMIT
# .devA/.devB: `python benchmarks/research/adapt/gpu_oracle.py pack --sketch SKETCH_DIR --out .devA,.devB`
# (both in .git/info/exclude; a fresh checkout has neither: pack them first, about 3 s, and add both to
# .git/info/exclude so `git status` stays clean). A dry run here: OUT=/tmp/out PAR=0 EXTRA="--stages 2 --max-train-per-class 3
# --epochs 1" bash benchmarks/research/adapt/gpu_bench.sh 400, after call 1's draw.
# Every run stops at LIMIT seconds (its finished stages stay in its run folder); what they wrote
# (json, md, logs; no weights) comes back as $OUT/bench.tgz.
set -u
LIMIT=${1:-450}
DEST=${OUT:-/tmp/out}
PAR=${PAR:-2}  # data-loading workers per run
B=/tmp/bench
mkdir -p "$B" "$DEST"
python3 benchmarks/research/adapt/gpu_oracle.py draw --src .devB --dst /tmp/sketch || exit 1
python3 benchmarks/research/adapt/gpu_oracle.py lists --manifest .devB/manifest.json || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
date -u +"start %T"
run() {  # NAME DATA SEED WORKERS METHODS
    timeout -s INT "$LIMIT" env OMP_NUM_THREADS=2 PYTHONPATH=. HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
        python3 -m drlcli benchmark --data "$2" --out "$B/$1" --ptm-weights /tmp/weights.safetensors \
        --methods "$5" --split B0Inc10 --seed "$3" --val-fraction 0.2 --workers "$4" ${EXTRA:-} \
        >"$B/$1.log" 2>&1 &
}
for s in 1993 1994 1995; do
    run "sk$s-sw" /tmp/sketch "$s" $((PAR + 1)) drl  # the default: the switched schedule
    run "sk$s" /tmp/sketch "$s" "$PAR" drl/preset=frozen,ranpac/preset=published
    run "ph$s" /tmp/photo "$s" "$PAR" drl/preset=frozen,ranpac/preset=published,drl
done
wait
date -u +"end %T"
for f in "$B"/*.log; do echo "== $f"; tail -n 4 "$f"; done
(cd "$B" && find . -path '*/data' -prune -o \( -name '*.json' -o -name '*.md' -o -name '*.log' \) -print |
    tar czf "$DEST/bench.tgz" -T -)
ls -la "$DEST"
