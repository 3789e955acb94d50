"""Throughput: samples, FLOPs and tokens per second, and MFU, in every epoch's logs."""

from __future__ import annotations

import time

from meshfit.cost.roofline import DEVICE_SPECS, device_spec
from meshfit.training.callback_protocol import Callback

#: Dense bfloat16 peak FLOP/s per device, by a fragment of JAX's `device_kind`: the peaks of the one table of
#: device specs (`meshfit.cost.roofline.DEVICE_SPECS`), which `meshfit.plan` reads too.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = tuple((fragment, spec.peak_flops) for fragment, spec in DEVICE_SPECS)


def peak_flops(device_kind: str) -> float | None:
    """The dense bfloat16 peak of one device of this kind, or None when it is not in the table."""
    spec = device_spec(device_kind)
    return None if spec is None else spec.peak_flops


class Throughput(Callback):
    """Adds `samples_per_second`, `flops_per_second` and `mfu` to each epoch's logs.

    The FLOPs of a step come from XLA's cost analysis of the compiled train step
    (`model.step_report()`, computed once when training begins), not from a
    formula. `flops_per_second` counts all devices (FLOPs per device x devices
    / step time) and `mfu = flops_per_second / (devices x peak_flops)`. Time is
    the training part of each epoch (validation excluded); the first epoch
    includes compilation. The logs then reach History, CSVLogger, TensorBoard
    and the progress bar: meshfit runs this callback before the others.

    Args:
        peak_flops: the peak FLOP/s of one device; by default looked up from the
            device kind in `PEAK_BF16_FLOPS` (dense bfloat16: under the float32
            policy the MFU is against the bfloat16 peak, as is usual). Without
            a peak there is no `mfu`.
        tokens_per_sample: adds `tokens_per_second` (e.g. the sequence length
            of a language model).
    """

    adds_epoch_logs = True

    def __init__(self, peak_flops: float | None = None, tokens_per_sample: int | None = None):
        super().__init__()
        for name, value in (("peak_flops", peak_flops), ("tokens_per_sample", tokens_per_sample)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"`{name}` must be a positive number or None. Received: {name}={value!r}.")
        self.peak_flops = peak_flops
        self.tokens_per_sample = tokens_per_sample
        self.report = None
        self._start = self._end = None
        self._start_step = 0

    def on_train_begin(self, logs=None):
        self.report = self.model.step_report()

    def on_epoch_begin(self, epoch, logs=None):
        self._start, self._end = time.perf_counter(), None
        self._start_step = self.context.step

    def on_test_begin(self, logs=None):
        if self._start is not None and self._end is None:  # validation: the epoch's training is done
            self._end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        start, end = self._start, self._end if self._end is not None else time.perf_counter()
        steps = self.context.step - self._start_step
        self._start = None
        if logs is None or start is None or steps <= 0 or end <= start:
            return
        logs.update(self.rates(steps, end - start))

    def rates(self, steps: int, seconds: float) -> dict[str, float]:
        """The throughput logs for `steps` training steps that took `seconds`."""
        report = self.report
        samples = steps * report.batch_size / seconds
        flops = steps * report.flops * report.num_devices / seconds
        out = {"samples_per_second": samples, "flops_per_second": flops}
        if self.tokens_per_sample:
            out["tokens_per_second"] = samples * self.tokens_per_sample
        peak = self.peak_flops or peak_flops(report.device_kind)
        if peak:
            out["mfu"] = flops / (report.num_devices * peak)
        return out
