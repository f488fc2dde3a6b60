#!/usr/bin/env bash
# Nightly "new classes arrived" pipeline (cron, CI): learn every new data drop, evaluate,
# export for serving, smoke-test the export. Safe to re-run: drops already learned are skipped,
# and a failed step leaves the run as it was (re-running resumes an interrupted stage).
#
#   bash examples/nightly.sh [DROPS_DIR] [WORK_DIR]
#
# DROPS_DIR holds one folder per drop, learned in name order (name them by date or number):
#   DROPS_DIR/2026-11-20/train/<class>/*.jpg     new classes only
#   DROPS_DIR/2026-11-20/test/<class>/*.jpg      optional; registered for every later eval
# Without DROPS_DIR the built-in offline default is used: two generated drops (another one is
# added with `python -m drlcli.synthetic drops WORK_DIR/drops --stages 1 --first 3`) and a tiny
# random ViT. With DROPS_DIR: PTM (default deit_tiny_patch16_224) with weights from
# DRL_PTM_WEIGHTS (a .safetensors; without it timm's hub download is tried).
#
# Other settings: EPOCHS (default 20, 2 for the offline default), DEVICE (auto), FORMATS
# (export formats, default "drl torchscript"; add onnx with pip install 'drlcli[export]').
# Exit status: the failing drl command's (see README "Exit codes"); 0 when all went well.
set -euo pipefail

work=${2:-nightly}
mkdir -p "$work/logs" "$work/models" "$work/reports"
export DRL_RUN=$work/run # every drl command below works on this run
device=${DEVICE:-auto}
formats=${FORMATS:-drl torchscript}
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

if [ -n "${1:-}" ]; then
    drops=$1
    epochs=${EPOCHS:-20}
else
    drops=$work/drops
    [ -d "$drops" ] || python -m drlcli.synthetic drops "$drops" --stages 2 >/dev/null
    epochs=${EPOCHS:-2}
fi

# 1. Once: create the run (exit 7 from info means "not a run directory yet").
status=0
drl info --json >"$work/logs/info.json" 2>/dev/null || status=$?
if [ "$status" -eq 7 ]; then
    log "creating the run $DRL_RUN"
    if [ -n "${1:-}" ]; then
        init_args=(--ptm "${PTM:-deit_tiny_patch16_224}")
    else
        read -r -a init_args <<<"$(python -m drlcli.synthetic init-args)"
    fi
    drl init "${init_args[@]}" --quiet
elif [ "$status" -ne 0 ]; then
    python -c 'import json, sys; print("error:", json.load(open(sys.argv[1]))["error"]["message"])' \
        "$work/logs/info.json" >&2
    exit "$status"
fi

# 2. Learn each drop whose classes are not learned yet, in name order.
learned=$(python -c 'import json, sys; r = json.load(open(sys.argv[1]))
print("\n".join(c for s in r.get("stages", []) for c in s["classes"]))' "$work/logs/info.json")
for drop in "$drops"/*/; do
    drop=${drop%/}
    name=$(basename "$drop")
    first_class=$(find "$drop/train" -mindepth 1 -maxdepth 1 -type d ! -name '.*' | sort | head -n 1)
    if [ -n "$first_class" ] && grep -Fxq "$(basename "$first_class")" <<<"$learned"; then
        continue # learned on an earlier night (a changed drop would be refused by learn-stage: exit 3)
    fi
    eval_args=()
    [ -d "$drop/test" ] && eval_args=(--eval-data "$drop/test")
    log "learning drop $name"
    drl learn-stage --data "$drop/train" ${eval_args[@]+"${eval_args[@]}"} --epochs "$epochs" \
        --device "$device" --json >"$work/logs/learn-$name.json"
    python -c 'import json, sys; r = json.load(open(sys.argv[1])); e = r["eval"]
top1 = ", top-1 on all seen %.2f%%" % e["top1"] if e else ""
print("stage %d: %d classes %s%s" % (r["stage"], len(r["classes"]), r["status"], top1))' \
        "$work/logs/learn-$name.json" >&2
done

# 3. Evaluate every registered test set: accuracy, matrix, forgetting, confusions (+ a plot
#    when matplotlib, the plot extra, is installed).
plot_args=()
python -c 'import matplotlib' 2>/dev/null && plot_args=(--plot "$work/reports/accuracy.png")
if compgen -G "$drops/*/test" >/dev/null; then # some drop registered test data
    drl eval --all-seen --device "$device" ${plot_args[@]+"${plot_args[@]}"} --json >"$work/reports/eval.json"
    python -c 'import json, sys; r = json.load(open(sys.argv[1]))
print("eval: top-1 %.2f%% on %d classes, mean forgetting %s, most confused %s" % (r["accuracy"]["top1"],
      r["num_classes"], r["history"]["mean_forgetting"], r["confused"][:1]))' "$work/reports/eval.json" >&2
fi

# 4. Export, named by the run's generation (it changes with every committed stage), and point
#    models/current.* at the newest file. Export only reads the run.
generation=$(drl info --json | python -c 'import json, sys; print(json.load(sys.stdin)["generation"])')
for format in $formats; do
    case $format in drl) ext=drl ;; torchscript) ext=pt ;; onnx) ext=onnx ;; *) ext=$format ;; esac
    model=model-g$generation.$ext
    [ -f "$work/models/$model" ] || drl export --format "$format" --out "$work/models/$model" --quiet
    ln -sfn "$model" "$work/models/current.$ext"
done

# 5. Smoke test: predict a few images of the newest drop with each exported file.
newest=$(find "$drops" -mindepth 1 -maxdepth 1 -type d ! -name '.*' | sort | tail -n 1)
for format in $formats; do
    case $format in drl) ext=drl ;; torchscript) ext=pt ;; onnx) ext=onnx ;; *) ext=$format ;; esac
    trust=()  # TorchScript runs code from the file: opt in, for the file this job exported itself
    [ "$format" = torchscript ] && trust=(--trust-code)
    find "$newest" -type f | sort | head -n 4 |
        drl predict --model "$work/models/current.$ext" ${trust[@]+"${trust[@]}"} --top-k 3 --device "$device" \
            --quiet - >"$work/reports/smoke-$ext.jsonl"
done
log "done: run $DRL_RUN, models in $work/models, reports in $work/reports"
