#!/bin/bash
# test runs for one dataset: bash queue_test.sh caltech SEEDS HEAD...
D=$1; S=$2; shift 2
cd /work/scratch/ptm
args=""
for h in "$@"; do args="$args --head $h"; done
nice -n 5 python search.py --data $D --split test --seeds $S --threads 1 $args
