"""The summary tables ``make bench`` prints at the end: each ratio beside its baseline and target."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.table import Table

from loadtest.benchmarks import served
from loadtest.harness import cli


def ratio_table(res: dict[str, Any]) -> cli.RatioTable:
    t = cli.RatioTable("hps-service benchmarks: ratios measured side by side in this run")
    row = t.row
    for r in res.get("l1", {}).get("per_batch", []):
        row(f"1. L1 hit lookup, batch {r['batch']}", f"{r['lookup_us']:.0f} us", f"gather {r['gather_us']:.0f} us",
            r["ratio_lookup"], cli.at_least(0.5))
    g = res.get("grpc")
    if g:
        served.rows(g, row)
    l3 = res.get("l3")
    if l3:
        row("3. L3 miss path vs rocksdict multi-get", f"{l3['ours_ms']:.2f} ms", f"{l3['raw_ms']:.2f} ms",
            l3["ratio"], cli.at_least(0.67))
    m = res.get("memory")
    if m:
        row("4. memory: hash map tier bytes/row",
            f"{m['hashmap_bytes_per_row']:.0f} B (process grew {m['hashmap_resident_bytes_per_row']:.0f} B/row)",
            f"raw {m['raw_row_bytes']} B",
            m["hashmap_ratio"], cli.at_most(1.3))
        row("4. memory: L1 cache bytes/row", f"{m['l1_bytes_per_row']:.0f} B", f"raw {m['raw_row_bytes']} B",
            m["l1_ratio"], cli.at_most(1.3))
    f = res.get("freshness")
    if f:
        if f.get("run") and f.get("p99_ms") is not None:
            row("6. freshness under load (publish -> served)", f"p99 {f['p99_ms']:.0f} ms", "", None, "p99 <= 1 s",
                f["p99_ms"] <= 1000)
        else:
            row("6. freshness under load", "not run", f.get("reason", "")[:60], None, "p99 <= 1 s", None)
    ing = res.get("ingest")
    if ing:
        row("7. lookups under 10k rows/s of ingest vs without",
            f"{ing['keys_per_s_ingest'] / 1e6:.2f} M keys/s ({ing['applied_rows_per_s']:,.0f} rows/s applied)",
            f"{ing['keys_per_s_idle'] / 1e6:.2f} M keys/s", ing["ratio"], cli.at_least(0.8))
    r = res.get("replicas")
    if r:
        if r.get("run") and r.get("bootstrap_s") and r.get("import_s"):
            ratio = r["bootstrap_s"] / r["import_s"]
            row(f"9. bootstrap of {r['rows']:,} x 64 from a snapshot", f"{r['bootstrap_s']:.1f} s",
                f"hps import {r['import_s']:.1f} s", ratio, cli.at_most(1.5))
        else:
            row("9. bootstrap from a snapshot", "not run", r.get("reason", "")[:60], None, cli.at_most(1.5))
        if r.get("catch_up_s"):
            row(f"9. catch-up behind {r['catch_up_rows']:,} rows", f"{r['catch_up_s']:.1f} s",
                f"{r['catch_up_rows_per_s']:,.0f} rows/s")
    _storage_rows(res, row)
    ro = res.get("rollout")
    if ro:
        row(f"15. version of {ro['rows']:,} x {ro['dim']} from the repository to ready on {ro['replicas']} replicas",
            f"{ro['all_ready_s']:.1f} s", f"hps import {ro['import_s']:.1f} s", ro["load_ratio"], cli.at_most(1.5))
        row("15. lookup p99 while it loads", f"{ro['p99_during_s'] * 1e3:.1f} ms",
            f"before {ro['p99_before_s'] * 1e3:.1f} ms", ro["p99_ratio"], cli.at_most(1.5))
    return t


def _storage_rows(res: dict[str, Any], row: Callable[..., None]) -> None:
    """Rows of part 13: memory, disk, gRPC speed and wire bytes of each quantised format against fp32's."""
    st = res.get("storage")
    for s, f in (st or {}).get("formats", {}).items():
        target = {"fp16": 0.55, "int8": 0.35}.get(s)
        if target is not None:
            row(f"13. {s} memory per row (L1 + hash map) vs fp32", f"{f['memory_per_row']:.0f} B",
                f"{st['formats']['fp32']['memory_per_row']:.0f} B", f["memory_x"], cli.at_most(target))
            row(f"13. {s} RocksDB bytes per row vs fp32", f"{f['disk_per_row']:.0f} B",
                f"{st['formats']['fp32']['disk_per_row']:.0f} B", f["disk_x"], cli.at_most(target))
    sg = res.get("storage_grpc")
    for s, f in (sg or {}).get("formats", {}).items():
        if s in ("fp16", "int8"):
            m = f["fp32"]
            row(f"13b. {s} table over gRPC (fp32 answers) vs fp32 keys/s", f"{m['keys_per_s'] / 1e6:.2f} M keys/s",
                "", m["keys_x"], cli.at_least(0.95))
            row(f"13b. {s} server CPU per call vs fp32", f"{m['server_cpu_ms_per_call']:.3f} ms", "", m["cpu_x"],
                cli.at_most(1 / 0.95))
            row(f"13b. {s} precision=stored wire bytes vs fp32", f"{f['stored']['wire_bytes']:,} B", "",
                f["stored"]["wire_x"])
    for dim, c in (res.get("storage_cliff") or {}).items():
        row(f"13c. table-size cliff of one hash-map budget, int8 vs fp32, dim {dim}", f"{c['fits']['int8']:,} rows",
            f"{c['fits']['fp32']:,} rows", c["cliff_x"], cli.at_least(2.9))
    if conv := res.get("storage_convert"):
        during = conv["lookups"]["copy"]
        row("13d. lookup p99 while a table converts to int8 vs before (one process)", f"{during['p99_ms']:.2f} ms",
            f"{conv['lookups']['before']['p99_ms']:.2f} ms", during["p99_x"])
    if ver := res.get("versions"):
        sw, mem = ver["switch"], ver["memory"]
        fleet = sorted(sw["fleet_s"])
        row(f"13e. label switch: every one of {sw['replicas']} replicas answering the new version, max of "
            f"{sw['switches']}", f"{fleet[-1] * 1e3:.0f} ms", f"PUT {max(sw['put_s']) * 1e3:.0f} ms",
            fleet[-1] / max(sw["put_s"]))
        row("13e. memory a dropped version frees, hash map / RocksDB (of what it added)",
            f"{mem['freed']['hashmap'] / 2**20:.0f} / {mem['freed']['rocksdb'] / 2**20:.0f} MiB",
            f"{mem['added']['hashmap'] / 2**20:.0f} / {mem['added']['rocksdb'] / 2**20:.0f} MiB",
            min(mem["freed_ratio"]["hashmap"], mem["freed_ratio"]["rocksdb"]))


def curves_table(curves: dict[str, list[dict[str, Any]]]) -> Table:
    t = Table(title="5. cost curves over gRPC", header_style="bold")
    for col in ("curve", "x", "M keys/s", "QPS", "p50 ms", "p99 ms", "server L1 hit", "errors"):
        t.add_column(col, justify="right")
    for name, key in (("batches", "batch"), ("table_sizes", "rows"), ("cache_fractions", "cache_fraction")):
        for q in curves.get(name, []):
            hit = (q.get("server_hit_rate") or {}).get("cache")
            t.add_row(name, f"{q[key]:,}" if isinstance(q[key], int) else f"{q[key]:g}", f"{q['keys_per_s'] / 1e6:.2f}",
                      f"{q['qps']:.0f}", f"{q['p50_ms'] or float('nan'):.1f}", f"{q['p99_ms'] or float('nan'):.1f}",
                      "-" if hit is None else f"{hit:.3f}", str(q["errors"]))
    return t
