"""Where and in what precision the trainer runs: device choice, autocast dtypes, fp16 loss scaling, peak FLOP/s."""

from __future__ import annotations

from typing import Literal

import torch

from hps_service.errors import FailedPreconditionError, InvalidArgumentError

Precision = Literal["fp32", "bf16", "fp16"]
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Dense peak TFLOP/s (no sparsity) by device name fragment, for model FLOPs utilisation: (tf32/fp32, bf16/fp16).
PEAK_TFLOPS = {
    "H200": (494.0, 989.0), "H100": (494.0, 989.0), "GH200": (494.0, 989.0), "B200": (1100.0, 2250.0),
    "A100": (156.0, 312.0), "L40S": (183.0, 362.0), "L4": (60.0, 121.0), "A10": (62.5, 125.0),
    "V100": (15.7, 125.0), "T4": (8.1, 65.0),
}


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available else cpu; ``cuda`` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise InvalidArgumentError(f"--device must be auto, cpu or cuda, not {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FailedPreconditionError("--device cuda, but torch sees no CUDA device")
    return torch.device(device)


def peak_flops(device: torch.device, precision: Precision) -> float | None:
    """The device's dense peak FLOP/s in ``precision``, where it is a GPU we know."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, (fp32, half) in PEAK_TFLOPS.items():
        if fragment in name:
            return (fp32 if precision == "fp32" else half) * 1e12
    return None


class LossScaler:
    """Dynamic loss scaling for fp16: halve and skip the step on inf/NaN gradients, double after a clean stretch."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self._good = 0
        self.skipped = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale /= 2.0
            self._good = 0
            self.skipped += 1
        else:
            self._good += 1
            if self._good % self.growth_interval == 0:
                self.scale *= 2.0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good": float(self._good), "skipped": float(self.skipped)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self._good, self.skipped = float(state["scale"]), int(state["good"]), int(state["skipped"])
