#!/bin/bash
# FeCAM-style per-class covariance heads on validation: bash queue_qda.sh DATA
cd /work/scratch/ptm
OPENBLAS_NUM_THREADS=1 nice -n 5 python search.py --data $1 --split val --seeds 1993,1994,1995 --threads 1 \
  --head qda:norm=l2,shrink=0.5,blend=0.5 --head qda:norm=l2,shrink=0.3,blend=0.8 --head qda:norm=l2,shrink=0.5,blend=0.5,logdet=1 --head qda:norm=l2,shrink=0.2,blend=0.5 --head lda:norm=l2,shrink=0.3 --head lda:shrink=0.01
