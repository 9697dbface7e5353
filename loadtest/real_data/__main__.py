"""``python -m loadtest.real_data --ml100k DIR``: ours and the two baselines on MovieLens 100K, as JSON and a table."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from loadtest.harness import cli
from loadtest.real_data import ml100k


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__spec__, ml100k.__doc__)
    parser.add_argument("--ml100k", type=Path, required=True, help="the directory holding ml-100k.inter/.user/.item")
    parser.add_argument("--test-fraction", type=float, default=0.2)
    parser.add_argument("--validation", action="store_true",
                        help="hold out the newest tenth of the training part instead (the held-out set is not read)")
    parser.add_argument("--no-dense", action="store_true", help="the one-hot fields only (the I fields empty)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("train_args", nargs="*", help="more hps train options (after --)")
    args = parser.parse_args(argv)
    cols = ml100k.load_ml100k(args.ml100k)
    split = int(len(cols["label"]) * (1 - args.test_fraction))
    if args.validation:
        cols = {k: v[:split] for k, v in cols.items()}
        split = int(split * 0.9)
    dense = None if args.no_dense else ml100k.dense_features(cols)
    table = {"samples": len(cols["label"]), "train": split, "test": len(cols["label"]) - split,
             "positive_rate": float(cols["label"].mean()), "validation": args.validation,
             "popularity": ml100k.popularity(cols, split, args.batch),
             "logistic": ml100k.logistic(cols, split, args.batch)}
    if dense is not None:
        table["logistic_dense"] = ml100k.logistic(cols, split, args.batch, dense)
    with tempfile.TemporaryDirectory(prefix="hps-ml100k-") as tmp:
        work = Path(tmp)
        train = ml100k.write_parquet(work / "train.parquet", cols, slice(0, split), dense)
        tests = {"heldout": ml100k.write_parquet(work / "test.parquet", cols, slice(split, None), dense)}
        if dense is not None:
            tests["frozen"] = ml100k.write_parquet(work / "frozen.parquet", cols, slice(split, None),
                                                   ml100k.dense_features(cols, frozen_after=split))
        table["ours"] = ml100k.ours(train, tests, work, args)
    print(json.dumps(table, indent=2))
    print(ml100k.markdown(table))
    return 0


if __name__ == "__main__":
    cli.run(main)
