"""An inference loop beside hps serve in its pod: embedding rows read from the server's shared store (LocalClient,
memory speed for the rows L1 and the hash map hold), scores from the dense tower the trainer exported.

    python examples/local_inference.py --store /dev/shm/hps --export-dir /models/dlrm --data day_23.tsv

The server runs with ``server.local: {enabled: true, path: /dev/shm/hps}`` (the chart's example
deploy/examples/values-local-reads.yaml runs this kind of container as a sidecar). Each batch asks for every id of
every sparse field once; ids the store does not hold go to the server over its Unix domain socket. The newest
exported tower is picked up between batches, as online training exports new ones. Needs ``hps-service[trainer]``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from hps_service.local import LocalClient
from hps_service.trainer.metrics import auc, log_loss
from hps_service.trainer.predictor import Predictor


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="/dev/shm/hps", help="the server's server.local.path")
    ap.add_argument("--export-dir", required=True, help="where the trainer exports its dense tower (hps train)")
    ap.add_argument("--data", nargs="+", required=True, help="labelled Criteo-format files to score")
    ap.add_argument("--format", default="criteo", choices=("criteo", "parquet"))
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--limit", type=int, default=None, help="score at most this many rows")
    ap.add_argument("--model", default=None, help="served model name (default: the exported tower's)")
    args = ap.parse_args(argv)
    with LocalClient(args.store, timeout=30) as rows, Predictor(args.export_dir, rows, model=args.model) as predictor:
        probs, labels, batches = [], [], 0
        started = time.perf_counter()
        for p, y in predictor.score_files(args.data, args.format, args.batch_size, args.limit):
            probs.append(p)
            labels.append(y)
            batches += 1
            if batches % 50 == 0 and predictor.reload():
                print(f"loaded tower version {predictor.version}", file=sys.stderr)
        total_s = time.perf_counter() - started
        prob, label = np.concatenate(probs), np.concatenate(labels)
        print(f"rows {prob.size}  AUC {auc(prob, label):.4f}  log-loss {log_loss(prob, label):.4f}  "
              f"(tower version {predictor.version}, rows from {'the shared store' if rows.mapped else 'the socket'}; "
              f"{batches} batches of {args.batch_size}, {1e3 * total_s / max(batches, 1):.2f} ms each with parsing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
