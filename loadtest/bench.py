"""The benchmark suite (``make bench``): every ratio measured side by side in one run on this machine.

1. L1 hit lookup in process vs a raw NumPy gather (loadtest.benchmarks.cache), batch 256..16384; target >= 0.5.
2. Served over gRPC from other processes (loadtest.benchmarks.served; batch 1024, dim 64, zipf(1.05); the embedded
   default, so on a CPU no L1: the hash map's compiled pass over the complete table), interleaved round by round
   (issue 52): the mix vs the hottest 20 % of the keys only (server CPU per call <= 1.15x); vs the transport floor
   (grpcio's thread-pool server answering a canned response of the same bytes, as many processes): <= 1.5x server
   CPU per call, >= 0.8x keys/s; the same node with server.front native (pygrpc-native): <= 0.75x, >= 1.2x of that
   floor, beside pygrpc-native's own canned answer (a second floor); vs a plain Redis Cluster client with as many
   masters as workers (hash-tagged MGET per master): >= 1.5x keys/s.
3. L3 miss path (loadtest.benchmarks.l3; no L1, no volatile tier) vs raw rocksdict multi-get of the same keys on
   the same store; >= 0.67x.
4. Bytes per row held by the in-process tiers (loadtest.benchmarks.memory: hash map, L1 arrays) over the raw row
   bytes; target <= 1.3x.
5. Cost curves over gRPC (loadtest.benchmarks.curves): keys/s and p99 vs batch size, table size and cache fraction
   (PNG).
6. Freshness under load: loadtest.benchmarks.updates run beside the lookup numbers (reported as not run if it
   fails).
7. Lookups under sustained ingest (loadtest.benchmarks.ingest): gRPC keys/s with vs without 10,000 rows/s of Kafka
   updates applied meanwhile, interleaved rounds; target >= 0.8x. With --profile also who holds the GIL meanwhile.
8. Sharding (loadtest.benchmarks.shards): fan-out keys/s and p99 through the client against 1, 2 and 4 shards
   beside an unsharded server (batch 1024 and 4096), and the import of a 1M-row table into 2 shards vs 1.
9. Replicas: bootstrap of a table from a snapshot in S3 vs ``hps import`` of the same rows (target <= 1.5x), and the
   catch-up of a replica behind rows on the topic (loadtest.benchmarks.bootstrap).
10-11. A node (loadtest.benchmarks.node): server CPU per all-hit call and keys/s vs the grpcio floor with as many
   processes (<= 1.5x, >= 0.8x; the native front <= 0.75x, >= 1.2x), workers 1 vs the CPUs and vs a Redis Cluster
   of as many masters (>= 1.5x), PSS per worker count; colocated reads: LocalClient vs gRPC (>= 10x) vs the raw
   gather (>= 0.3x); 11f: LocalClient and the in-process lookup with L1 off vs on (>= 1x).
12. Tracing (loadtest.benchmarks.tracing): server CPU per all-hit call with server.tracing off vs the base
   commit's code (no cost when off), and on (unsampled, every call sampled) vs off.
13. Quantised rows (loadtest.benchmarks.storage, storage_grpc, storage_cliff): memory and disk per row of
   fp16 / bf16 / int8 vs fp32 (<= 0.55x / 0.35x), gRPC keys/s and server CPU (>= 0.95x), wire bytes with
   precision=stored, and the table-size cliff of one hash-map budget (int8 >= 2.9x fp32's); 13d: a served table
   converted to int8 (loadtest.benchmarks.convert): copy rate, and lookups before, during and after; 13e: model
   versions (loadtest.benchmarks.versions): a label switch across 3 replicas, and the memory a dropped version frees.
14. Pooled lookups (loadtest.benchmarks.bags): lookup_bags vs per-key lookups pooled by the caller (>= 2x keys/s at
   mean bag 32) and vs a Redis Cluster client pooling likewise (>= 3x); response bytes 1/mean bag length of the
   per-key answer's; server CPU per pooled key vs a plain lookup's (<= 1.0x).
15. A rollout (loadtest.benchmarks.rollout): a version from the model repository (SeaweedFS) to ready on 3 replicas
   vs ``hps import`` of the same file (<= 1.5x), and the lookups' p99 meanwhile vs before (<= 1.5x).
16. PyTorch (loadtest.benchmarks.torch_dlrm): a DLRM-sized embedding step (batch 512, 26 features of mean bag 20,
   dim 64) through HPSEmbeddingBagCollection over LocalClient (>= 0.5x TorchRec's EmbeddingBagCollection in
   process) and over gRPC; prefetch hiding >= 80% of the lookup behind a dense step of equal length.

2. runs the server with its default worker processes (the CPUs) and the floors with as many processes.

    python -m loadtest.bench            # ~10 min on 2 cores
    python -m loadtest.bench --quick    # ~2-3 min
    python -m loadtest.bench --table-sizes 1000000,5000000,20000000 --profile
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.benchmarks import l3, memory, served
from loadtest.benchmarks.curves import curve_batches, curve_cache_fractions, curve_table_sizes, plot_curves
from loadtest.harness import cli
from loadtest.harness.embedded import EmbeddedServer
from loadtest.harness.plan import DIM, plan
from loadtest.harness.report import machine
from loadtest.harness.summary import curves_table, ratio_table
from loadtest.harness.workload import load_keys


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__spec__, __doc__)
    ap.add_argument("--quick", action="store_true", help="smaller tables and shorter runs (~2-3 min)")
    ap.add_argument("--table-sizes", default=None, help="rows of the table-size curve, e.g. 1000000,5000000,20000000")
    ap.add_argument("--profile", action="store_true", help="py-spy the server under the gRPC load")
    ap.add_argument("--cache-fraction", type=float, default=0.2,
                    help="the hottest ranks asked by 2.'s hot-keys contender, and the L1 capacity of the batch "
                         "curve's table (0.2: the embedded default)")
    ap.add_argument("--skip", default="",
                    help="comma-separated parts to skip: l1,grpc,curves,l3,memory,freshness,ingest,shards,replicas,"
                         "node,tracing,storage,bags,rollout,torch")
    cli.add_out(ap)
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    p = plan(args.quick, args.table_sizes)
    console = cli.console()
    started = time.perf_counter()
    res: dict[str, Any] = {"machine": machine(), "plan": asdict(p), "quick": args.quick}
    workdir = Path(tempfile.mkdtemp(prefix="hps-bench-"))
    try:
        if "l1" not in skip:
            from loadtest.benchmarks import cache

            console.rule("1. L1 hit path vs raw NumPy gather (loadtest.benchmarks.cache)")
            res["l1"] = cache.part(p)
        base = EmbeddedServer(workdir / "base", rows=p.rows, table_dim=DIM,
                              overrides={"cache": {"capacity": args.cache_fraction}})
        if {"grpc", "curves", "l3"} - skip:
            console.rule(f"setup: hps synth + hps import of {p.rows:,} x {DIM} rows")
            t0 = time.perf_counter()
            base.prepare()
            res["setup_s"] = time.perf_counter() - t0
        if {"grpc", "curves"} - skip:
            base.start()
            try:
                if "grpc" not in skip:
                    console.rule("2. served over gRPC vs the transport floor and Redis Cluster "
                                 "(loadtest.benchmarks.served)")
                    res["grpc"] = served.part(p, base, workdir, console, args.profile, args.cache_fraction)
                if "curves" not in skip:
                    console.rule("5. cost curves: batch size (loadtest.benchmarks.curves)")
                    res.setdefault("curves", {})["batches"] = curve_batches(base, p)
            finally:
                base.stop()
        if "l3" not in skip:
            console.rule("3. L3 miss path vs raw rocksdict multi-get (loadtest.benchmarks.l3)")
            res["l3"] = l3.part(p, base.workdir / "rocksdb", load_keys(base.keys_file))
        if "memory" not in skip:
            console.rule("4. memory per row (loadtest.benchmarks.memory)")
            res["memory"] = memory.part(p)
        if "curves" not in skip:
            curves = res.setdefault("curves", {})
            console.rule("5. cost curves: cache fraction")
            curves["cache_fractions"] = curve_cache_fractions(p, workdir)
            console.rule("5. cost curves: table size")
            at_1024 = next((q for q in curves.get("batches", []) if q["batch"] == 1024), None)
            curves["table_sizes"] = curve_table_sizes(p, workdir, at_1024 or {}, console) if at_1024 else []
            res["curves_png"] = str(plot_curves(curves, args.out / "bench-cost-curves.png"))
        if "freshness" not in skip:
            from loadtest.benchmarks import updates

            console.rule("6. freshness under load (loadtest.benchmarks.updates)")
            res["freshness"] = updates.part(p)
        if "ingest" not in skip:
            from loadtest.benchmarks import ingest

            console.rule("7. lookups under sustained ingest (loadtest.benchmarks.ingest)")
            res["ingest"] = ingest.part(p, workdir, console, args.profile)
        if "shards" not in skip:
            from loadtest.benchmarks import shards

            res["shards"] = shards.run(args.quick, console)
        if "replicas" not in skip:
            from loadtest.benchmarks import bootstrap

            console.rule("9. replicas: bootstrap from a snapshot vs hps import, catch-up "
                         "(loadtest.benchmarks.bootstrap)")
            res["replicas"] = bootstrap.part(args.quick)
        if "node" not in skip:
            from loadtest.benchmarks import node

            console.rule("10-11. a node's worker processes, colocated reads (loadtest.benchmarks.node)")
            node_plan = node.plan(args.quick, None, None, None)
            res["node"] = {"plan": asdict(node_plan), **node.bench_nodes(node_plan, workdir, console)}
        if "tracing" not in skip:
            from loadtest.benchmarks import tracing

            console.rule("12. tracing off vs the base commit, and on (loadtest.benchmarks.tracing)")
            res["tracing"] = tracing.run(args.quick, console)
        if "storage" not in skip:
            from loadtest.benchmarks import storage, storage_cliff, storage_grpc

            console.rule("13. quantised rows: memory, disk and lookup speed per format (loadtest.benchmarks.storage)")
            res["storage"] = storage.run(200_000 if args.quick else 1_000_000, 64, console)
            console.rule("13b. quantised rows over gRPC: keys/s, server CPU and wire bytes "
                         "(loadtest.benchmarks.storage_grpc)")
            res["storage_grpc"] = storage_grpc.run(100_000 if args.quick else 1_000_000, console)
            console.rule("13c. quantised rows: the table-size cliff of one hash-map budget "
                         "(loadtest.benchmarks.storage_cliff)")
            res["storage_cliff"] = {dim: storage_cliff.run(8 if args.quick else 64, dim, console)
                                    for dim in (64, 128)}
            from loadtest.benchmarks import convert

            console.rule("13d. a served table converted to int8: copy rate, lookups meanwhile "
                         "(loadtest.benchmarks.convert)")
            res["storage_convert"] = convert.run(200_000 if args.quick else 1_000_000, 64, console)
            from loadtest.benchmarks import versions

            console.rule("13e. model versions: a label switch across 3 replicas, memory a dropped version frees "
                         "(loadtest.benchmarks.versions)")
            res["versions"] = versions.run(200_000 if args.quick else 1_000_000, 64, 4 if args.quick else 10,
                                           console)
        if "bags" not in skip:
            from loadtest.benchmarks import bags

            console.rule("14. pooled lookups vs the caller's pooling and Redis (loadtest.benchmarks.bags)")
            res["bags"] = bags.bench(200_000 if args.quick else 1_000_000, 6.0 if args.quick else 12.0, console)
        if "rollout" not in skip:
            from loadtest.benchmarks import rollout

            console.rule("15. a version from the model repository to ready on 3 replicas vs hps import, lookups "
                         "meanwhile (loadtest.benchmarks.rollout)")
            res["rollout"] = rollout.run(200_000 if args.quick else 1_000_000, 64, 3, console, workers=1)
        if "torch" not in skip:
            from loadtest.benchmarks import torch_dlrm

            console.rule("16. a DLRM step in PyTorch: HPSEmbeddingBagCollection vs TorchRec's EBC, prefetch "
                         "(loadtest.benchmarks.torch_dlrm)")
            res["torch"] = torch_dlrm.bench(5_000 if args.quick else 20_000, 6.0 if args.quick else 20.0, console)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        res["elapsed_s"] = time.perf_counter() - started
        path = cli.write_result(res, args.out, "bench")
        shutil.copyfile(path, args.out / "bench-latest.json")
    console.print(ratio_table(res))
    if res.get("curves"):
        console.print(curves_table(res["curves"]))
    if res.get("shards"):
        from loadtest.benchmarks import shards

        console.print(shards.table(res["shards"]))
    if res.get("node"):
        from loadtest.benchmarks import node

        console.print(node.table(res["node"]))
    if res.get("tracing"):
        from loadtest.benchmarks import tracing

        console.print(tracing.table(res["tracing"]))
    if res.get("bags"):
        from loadtest.benchmarks import bags

        console.print(bags.table(res["bags"]))
    if res.get("torch"):
        from loadtest.benchmarks import torch_dlrm

        console.print(torch_dlrm.table(res["torch"]))
    prof = (res.get("grpc") or {}).get("profile")
    if prof and "by_category" in prof:
        console.print(f"server under gRPC load (py-spy --gil): GIL held {prof['gil_busy']:.0%} of the time; by part: " + ", ".join(
            f"{k} {v:.0%}" for k, v in prof["by_category"].items()))
    console.print(f"machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, "
                  f"{res['machine']['memory_gib']} GiB; load average at start {res['machine']['load_average_at_start']}")
    console.print(f"wrote {path} (and bench-latest.json) in {res['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    cli.run(main)
