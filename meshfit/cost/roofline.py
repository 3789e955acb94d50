"""What a device can do, and how long a step takes on it by a roofline: one table for the whole package.

`DEVICE_SPECS` holds, per `device_kind`, the dense bfloat16 peak FLOP/s, the
HBM bandwidth and the interconnect bandwidth of one device (the vendors'
datasheets; SXM parts for NVIDIA, NVLink and ICI bandwidth per direction).
`meshfit.callbacks.Throughput` reads its peaks for MFU, `meshfit.plan` all
three for `step_time`. A device kind the table lacks is looked up as `None`:
pass your own `DeviceSpec`. `HOST_CPU` is a nominal spec for CPU devices
(simulated ones share the host's cores): a stand-in so a plan can rank
layouts on a laptop, not a measurement.
"""

from __future__ import annotations

from typing import NamedTuple

from meshfit.cost.step_report import StepReport


class DeviceSpec(NamedTuple):
    """One device's peaks.

    Attributes:
        peak_flops: dense bfloat16 FLOP/s.
        memory_bandwidth: bytes/s between the device's memory and its cores (HBM).
        interconnect_bandwidth: bytes/s one device sends to the others (per direction).
    """

    peak_flops: float
    memory_bandwidth: float
    interconnect_bandwidth: float


#: Specs by a fragment of JAX's `device_kind`, checked in order: the first fragment the kind contains wins.
DEVICE_SPECS: tuple[tuple[str, DeviceSpec], ...] = (
    ("GB200", DeviceSpec(2.5e15, 8.0e12, 900e9)),
    ("B200", DeviceSpec(2.25e15, 8.0e12, 900e9)),
    ("H200", DeviceSpec(989e12, 4.8e12, 450e9)),
    ("H100", DeviceSpec(989e12, 3.35e12, 450e9)),
    ("A100", DeviceSpec(312e12, 2.039e12, 300e9)),
    ("TPU v6 lite", DeviceSpec(918e12, 1.64e12, 448e9)),  # v6e
    ("TPU v5 lite", DeviceSpec(197e12, 819e9, 200e9)),  # v5e
    ("TPU v5p", DeviceSpec(459e12, 2.765e12, 600e9)),
    ("TPU v5", DeviceSpec(459e12, 2.765e12, 600e9)),  # v5p reports "TPU v5"
    ("TPU v4", DeviceSpec(275e12, 1.2e12, 300e9)),
)

#: A nominal CPU device (a core or two of a current x86 host, memory copies for collectives).
HOST_CPU = DeviceSpec(peak_flops=50e9, memory_bandwidth=10e9, interconnect_bandwidth=5e9)


def device_spec(device_kind: str) -> DeviceSpec | None:
    """The spec of one device of this kind from `DEVICE_SPECS`, or None when it is not in the table."""
    for fragment, spec in DEVICE_SPECS:
        if fragment.lower() in device_kind.lower():
            return spec
    return None


class StepTime(NamedTuple):
    """A step's predicted seconds on one device, by part: a lower bound, the device at its peaks.

    No launch overhead, imperfect overlap or host time is counted: a real step takes longer (on an H100, a
    1B decoder's step took 3x its roofline). `meshfit.plan(measure=K)` times real steps.

    Attributes:
        compute: FLOPs / peak FLOP/s.
        memory: bytes accessed / memory bandwidth.
        collectives: collective operand bytes / interconnect bandwidth (not overlapped with the rest).
    """

    compute: float
    memory: float
    collectives: float

    @property
    def total(self) -> float:
        """max(compute, memory) + collectives: the roofline's step time."""
        return max(self.compute, self.memory) + self.collectives

    @property
    def bound(self) -> str:
        """What limits the step: "compute", "memory" or "collectives"."""
        slowest = max(self.compute, self.memory)
        if self.collectives > slowest:
            return "collectives"
        return "compute" if self.compute >= self.memory else "memory"


def step_time(report: StepReport, spec: DeviceSpec) -> StepTime:
    """The roofline of one compiled step (`StepReport`, per device) on a device of `spec`.

    A device's FLOPs and bytes are the larger of XLA's two counts: the whole
    step's divided over the devices (misses work each device repeats, as under
    tensor-parallel layouts with replicated activations) and the compiled
    program's of one device (misses library calls on GPU). A pipelined step's
    collective-permutes count as its point-to-point bytes over all ticks (the
    compiled program shows a loop's sends once).
    """
    collectives = dict(report.collectives)
    if report.pipeline is not None:
        collectives["collective-permute"] = max(collectives.get("collective-permute", 0), report.pipeline.p2p_bytes)
    return StepTime(
        compute=max(report.flops, report.device_flops) / spec.peak_flops,
        memory=max(report.bytes_accessed, report.device_bytes_accessed) / spec.memory_bandwidth,
        collectives=sum(collectives.values()) / spec.interconnect_bandwidth,
    )
