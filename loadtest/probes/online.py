"""The planted teacher at the demo's sizes: the gap to the oracle on the full held-out set, and samples/s with and
without the online options (admission, expiry, publishing in the background), all in one process.

    python -m loadtest.probes.online                 # 700 steps of 4096 over 3 x 1500 ids, 4 experts (minutes)
    python -m loadtest.probes.online --steps 100 --throughput-only
"""

from __future__ import annotations

import json

import torch

from hps_service.cli.demo import DemoSettings
from hps_service.config import ModelConfig, TableConfig
from hps_service.trainer.factory import RunSpec, build_run
from hps_service.trainer.rowstore import LatestRowStore
from hps_service.trainer.train import TrainConfig, Trainer
from loadtest.harness import cli


def _run(steps: int, online: bool, holdout: int) -> dict:
    demo = DemoSettings()
    model_cfg = ModelConfig(name="demo", tables=[TableConfig(name=t, dim=demo.dim) for t in demo.tables])
    dlrm, data = build_run(model_cfg, RunSpec(cardinality=demo.cardinality, experts=demo.experts, top_k=demo.top_k,
                                              seed=0))
    store = LatestRowStore(dict.fromkeys(demo.tables, demo.dim))
    extra = {"admit_after": 2, "expire_after_steps": 200} if online else {}
    cfg = TrainConfig(steps=steps, batch_size=demo.batch_size, publish_every_steps=10, publish_every_s=0.5, eval_every=50,
                      holdout_size=holdout, **extra)
    return Trainer(dlrm, data, cfg, publisher=store, model_name="demo").run()


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__spec__, __doc__)
    parser.add_argument("--steps", type=int, default=DemoSettings().steps)
    parser.add_argument("--holdout", type=int, default=10_000)
    parser.add_argument("--throughput-only", action="store_true", help="skip the run without the options")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = {}
    for online in ((True,) if args.throughput_only else (False, True)):
        m = _run(args.steps, online, args.holdout)
        out["online" if online else "plain"] = {
            "samples_per_s": m["samples_per_s"], "final": m["final"], "progressive": m["progressive"]["rolling"],
            "publish_wait_s": m["publishing"]["step_wait_s"], "train_s": m["train_s"],
            "rows_published": m["publishing"]["rows_published"], "tables": m["tables"],
        }
        print(json.dumps(out["online" if online else "plain"], indent=1), flush=True)
    if "plain" in out:
        print(f"samples/s with the options / without: {out['online']['samples_per_s'] / out['plain']['samples_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    cli.run(main)
