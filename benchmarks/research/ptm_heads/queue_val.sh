#!/bin/bash
# validation search for one dataset: bash queue_val.sh caltech
D=$1
cd /work/scratch/ptm
H1="--head ncm --head ncm:metric=euc --head ridge:M=0 --head lda:shrink=0.01 --head lda:shrink=0.1 --head lda:shrink=0.3 --head lda:norm=l2,shrink=0.1 --head lda:norm=l2,shrink=0.3 --head ridge:M=1000 --head ridge:M=1000,std=l2"
H2="--head qda:norm=l2,shrink=0.5,blend=0.5 --head qda:norm=l2,shrink=0.3,blend=0.8 --head qda:norm=l2,shrink=0.5,blend=0.5,logdet=1"
H3="--head ridge:M=3000"
nice -n 5 python search.py --data $D --split val --seeds 1993,1994,1995 --threads 1 $H1 $H3 $H2
