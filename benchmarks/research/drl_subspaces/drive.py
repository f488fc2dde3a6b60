"""Continue a benchmark-created DRL run stage by stage WITHOUT the per-stage evaluation
(saves CPU); same run dir, same materialised stage folders, same stored config, so the stages
are exactly what `drl benchmark` would train.

    python drive.py OUT_DIR N_STAGES        # e.g. /work/scratch/drl/cal 11
"""
import sys
import time
from pathlib import Path

import torch

from drlcli import api

WEIGHTS = Path("/work/shared/data/deit_tiny_patch16_224/deit_tiny_patch16_224.safetensors")
out, n = Path(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
run_dir = next((out / "runs").iterdir())
for k in range(1, n + 1):
    t0 = time.time()
    r = api.learn_stage(run_dir, data_dir=out / "data" / f"stage_{k:02d}" / "train", device="cpu", ptm_weights=WEIGHTS)
    print(f"stage {k} committed ({time.time() - t0:.0f}s) {time.strftime('%H:%M:%S')}", flush=True)
