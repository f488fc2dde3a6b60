#!/bin/bash
# lean validation queue for the remaining seeds: bash queue_val2.sh caltech 1994,1995
D=$1; S=$2
cd /work/scratch/ptm
nice -n 5 python search.py --data $D --split val --seeds $S --threads 1 --head ncm --head lda:norm=l2,shrink=0.1 --head lda:shrink=0.1 --head ridge:M=3000,f32=1 --head ridge:M=3000,bal=1,f32=1
