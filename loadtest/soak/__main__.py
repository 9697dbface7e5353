"""``python -m loadtest.soak`` (``make soak``): the soak's command line; prints the verdict, exits 0 on PASS."""

from __future__ import annotations

from pathlib import Path

import loadtest.soak
from loadtest.harness import cli
from loadtest.soak.result import Limits
from loadtest.soak.run import plan_publishing, run_soak


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__spec__, loadtest.soak.__doc__)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    parser.add_argument("--interval", type=float, default=None, help="seconds per sample (default duration/60, "
                        "between 2 and 30)")
    parser.add_argument("--out", type=Path, default=cli.RESULTS / "soak")
    parser.add_argument("--brokers", default=None, help="an existing broker; default: start a local tansu")
    parser.add_argument("--broker-pid", type=int, default=None, help="its pid, to plot its CPU and RSS")
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--lookup-workers", type=int, default=2)
    parser.add_argument("--rows-per-s", type=int, default=10_000, help="distinct rows published per second")
    parser.add_argument("--publish-every", type=float, default=1.0, help="seconds between publishes (at least)")
    parser.add_argument("--partitions", type=int, default=4, help="partitions of the soak's update topic")
    parser.add_argument("--compression", default="lz4", help="producer compression.type")
    parser.add_argument("--max-record-batches", type=int, default=20_000,
                        help="bound on the record batches the broker's log holds at the end")
    parser.add_argument("--max-no-apply", type=float, default=30.0, help="FAIL once rows waited this long with "
                        "nothing applied")
    parser.add_argument("--min-lookup-ratio", type=float, default=0.8, help="lookups per interval, late / early")
    parser.add_argument("--max-p99-ratio", type=float, default=1.5, help="p99, late / early")
    parser.add_argument("--max-mem-growth", type=float, default=0.05,
                        help="fitted growth of PSS net of memtables and block cache over the last half")
    args = parser.parse_args(argv)
    interval = args.interval or min(30.0, max(2.0, args.duration / 60))
    limits = Limits(max_no_apply_s=args.max_no_apply, min_lookup_ratio=args.min_lookup_ratio,
                    max_p99_ratio=args.max_p99_ratio, max_mem_growth=args.max_mem_growth)
    every, rows, batches = plan_publishing(args.duration, args.rows_per_s, args.publish_every, args.partitions,
                                           args.max_record_batches, args.keys)
    print(f"soak {args.duration:.0f} s: {rows} rows every {every:.2f} s ({rows / every:,.0f} rows/s) on "
          f"{args.partitions} partitions, {args.compression}; the broker's log ends at {batches} record batches "
          f"(bound {args.max_record_batches}); sampling every {interval:.0f} s", flush=True)
    result = run_soak(args.duration, interval, args.out, brokers=args.brokers, broker_pid=args.broker_pid,
                      keys=args.keys, dim=args.dim, lookup_workers=args.lookup_workers, rows_per_s=args.rows_per_s,
                      publish_every_s=args.publish_every, partitions=args.partitions, compression=args.compression,
                      max_record_batches=args.max_record_batches, limits=limits)
    print(f"ran {result.ran_s:.0f} s: {result.lookups} lookups, {result.rows_published} rows published, "
          f"{result.rows_applied} applied")
    for check in result.checks:
        print(f"  {'ok  ' if check.passed else 'FAIL'} {check.name}: {check.detail}")
    print(f"plot: {result.plot}")
    print("PASS" if result.passed else "FAIL")
    return 0 if result.passed else 1


if __name__ == "__main__":
    cli.run(main)
