"""Device check of the trainer: the same run on the GPU in fp32, bf16 and fp16 next to the CPU in fp32.

``python -m loadtest.probes.gpu_trainer_check`` on a machine with a CUDA GPU and the ``trainer`` extra, in a few minutes:
trains the DLRM + MoE on the planted teacher (3 tables x 5000 ids, batch 4096) for ``--steps`` steps on the CPU in
fp32 and on the GPU in fp32, bf16 and fp16, and prints for each the final AUC gap to the oracle, samples/s, model
FLOP/s and MFU against the device's peak. Every GPU run must end within 0.01 AUC of the CPU run and keep fp32
weights. Exit status 0 when they do, 1 when one does not, 2 when there is no usable CUDA device.
"""

from __future__ import annotations

import sys

import torch

from hps_service.config import ModelConfig, TableConfig
from hps_service.trainer.factory import RunSpec, build_run
from hps_service.trainer.train import TrainConfig, Trainer
from loadtest.harness import cli


def _run(device: str, precision: str, steps: int, batch: int) -> dict:
    model_cfg = ModelConfig(name="check", tables=[TableConfig(name=t, dim=16) for t in ("user", "item", "category")])
    dlrm, data = build_run(model_cfg, RunSpec(cardinality=5000, experts=4, top_k=2, seed=0))
    metrics = Trainer(dlrm, data, TrainConfig(steps=steps, batch_size=batch, eval_every=steps, holdout_size=20_000,
                                              device=device, precision=precision)).run()  # type: ignore[arg-type]
    if any(p.dtype != torch.float32 for p in dlrm.tower.parameters()):
        raise SystemExit(f"{device} {precision}: weights are not fp32")
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__spec__, __doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4096)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    torch.set_num_threads(4)
    runs = [("cpu", "fp32"), ("cuda", "fp32"), ("cuda", "bf16"), ("cuda", "fp16")]
    results = {run: _run(*run, args.steps, args.batch_size) for run in runs}
    cpu_auc = results[("cpu", "fp32")]["final"]["auc"]
    ok = True
    for (device, precision), m in results.items():
        mfu = f"{m['mfu']:.2%}" if m["mfu"] is not None else "-"
        diff = m["final"]["auc"] - cpu_auc
        print(f"{device:>4} {precision}: AUC gap to oracle {m['final']['auc_gap']:.4f} ({diff:+.4f} vs CPU)  "
              f"{m['samples_per_s']:>10,.0f} samples/s  {m['model_flops_per_s'] / 1e9:8.1f} GFLOP/s  MFU {mfu}  "
              f"fp16 skipped steps {m['fp16_skipped_steps']}")
        ok &= abs(diff) <= 0.01
    return 0 if ok else 1


if __name__ == "__main__":
    cli.run(main)
