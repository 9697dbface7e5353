"""Trainer throughput, 1 process vs data-parallel under torchrun, on the same Criteo-format file, side by side.

Writes a planted-signal click log (26 hex categorical fields, 13 integer features), trains one pass with
``python -m hps_service.trainer`` in 1 process, then with ``torchrun --nproc-per-node N`` (gloo on the CPU), and
prints samples/s over the last 50 steps (reading the data included), model FLOP/s, the final AUC of each and the
ratios, and the CPU seconds each run used (what the wall-clock ratio means only on otherwise idle cores).

    python -m loadtest.probes.trainer                       # 1 vs 2 processes, 200k rows, batch 4096
    python -m loadtest.probes.trainer --rows 400000 --nproc 2 --experts 0
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from loadtest.harness import cli


def _write_data(path: Path, rows: int) -> None:
    sys.path.insert(0, str(cli.REPO))
    from tests.trainer.criteo_data import make_rows, write_tsv

    write_tsv(path, make_rows(rows, seed=1))


def _run(nproc: int, args: list[str], out: Path) -> tuple[dict, float]:
    """The run's metrics and the CPU seconds its processes used (user + sys, launcher included)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(cli.REPO)}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "hps_service.trainer"]
    else:
        cmd = [sys.executable, "-m", "hps_service.trainer"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run([*cmd, *args, "--metrics-out", str(out)], capture_output=True, text=True, env=env,
                            cwd=cli.REPO)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{nproc}-process run failed:\n{result.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out.read_text()), cpu


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__spec__, __doc__)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--dim", type=int, default=16)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hps-bench-trainer-") as tmp:
        work = Path(tmp)
        data = work / "day_0"
        _write_data(data, args.rows)
        config = work / "ctr.yaml"
        config.write_text(yaml.safe_dump({"updates": {"type": "disabled"}, "models": [{"name": "ctr", "tables": [
            {"name": f"C{i}", "dim": args.dim, "default": "hashed_random"} for i in range(1, 27)]}]}))
        common = ["--config", str(config), "--data", str(data), "--batch-size", str(args.batch_size),
                  "--holdout", "last:20000", "--eval-every", "1000000", "--experts", str(args.experts),
                  "--no-progress", "--device", "cpu", "--threads", "1"]
        one, cpu_one = _run(1, common, work / "m1.json")
        many, cpu_many = _run(args.nproc, common, work / "mn.json")
    print(f"Criteo-format file: {args.rows:,} rows, 26 tables x dim {args.dim}, batch {args.batch_size}, "
          f"{args.experts} experts, {one['steps']} steps, {os.cpu_count()} cores")
    for name, m in (("1 process", one), (f"{args.nproc} processes", many)):
        print(f"  {name:>12}: {m['samples_per_s']:>10,.0f} samples/s  {m['model_flops_per_s'] / 1e9:6.2f} GFLOP/s  "
              f"AUC {m['final']['auc']:.4f}")
    print(f"  ratio {args.nproc}/1: {many['samples_per_s'] / one['samples_per_s']:.2f}x samples/s, "
          f"AUC difference {many['final']['auc'] - one['final']['auc']:+.4f}")
    print(f"  CPU seconds of the whole run (start-ups, reading, training, evaluation): 1 process {cpu_one:.1f}, "
          f"{args.nproc} processes {cpu_many:.1f}")
    eff = many["samples_per_cpu_s"] / one["samples_per_cpu_s"]
    print(f"  training loop (reading + steps), samples per CPU second summed over ranks: 1 process "
          f"{one['samples_per_cpu_s']:,.0f}, {args.nproc} processes {many['samples_per_cpu_s']:,.0f} ({eff:.2f}x): "
          f"on {args.nproc} idle cores {args.nproc} processes would train {args.nproc * eff:.2f}x as fast. "
          f"Load average now: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    cli.run(main)
