"""The tables of docs/research/covariance-rank.md from replay.py's JSON lines: per data set, split and
rank, Ā ± std over the class orders / A_T / mean forgetting, capped and full.

    python summary.py /work/scratch/cov_rank.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def main() -> None:
    rows = defaultdict(list)
    for line in open(sys.argv[1]):
        record = json.loads(line)
        rows[record["feats"], record["split"], int(record["rank"])].append(record)
    for (feats, split, rank), records in sorted(rows.items()):
        cells = []
        for kind in ("capped", "full"):
            avg = [r[kind]["average"] for r in records]
            last = [r[kind]["last"] for r in records]
            forget = [r[kind]["forgetting"] for r in records]
            std = statistics.stdev(avg) if len(avg) > 1 else 0.0
            cells.append(
                f"{statistics.mean(avg):.2f}±{std:.2f} / {statistics.mean(last):.2f} / F {statistics.mean(forget):.2f}"
            )
        seeds = ",".join(str(r["seed"]) for r in records)
        print(f"| {feats} | {split} | {rank} | {cells[0]} | {cells[1]} | {seeds} |")


if __name__ == "__main__":
    main()
