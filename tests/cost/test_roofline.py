"""`meshfit.cost.roofline`: one table of device specs, and a step's time by the roofline."""

import pytest

from meshfit.callbacks.throughput import peak_flops
from meshfit.cost import roofline
from meshfit.cost.roofline import DeviceSpec, StepTime
from meshfit.cost.step_report import StepReport


def report(flops, bytes_accessed, collectives, device_flops=0.0, device_bytes=0.0):
    return StepReport(
        flops=flops,
        bytes_accessed=bytes_accessed,
        batch_size=8,
        num_devices=4,
        device_kind="test",
        memory={},
        collectives=collectives,
        lowered_collectives={},
        device_flops=device_flops,
        device_bytes_accessed=device_bytes,
    )


def test_the_slower_of_compute_and_memory_plus_the_collectives():
    spec = DeviceSpec(peak_flops=1e12, memory_bandwidth=1e11, interconnect_bandwidth=1e10)
    time = roofline.step_time(report(2e9, 1e8, {"all-reduce": 3e7, "all-gather": 2e7}), spec)
    assert time == StepTime(compute=2e-3, memory=1e-3, collectives=5e-3)
    assert time.total == pytest.approx(2e-3 + 5e-3) and time.bound == "collectives"
    assert roofline.step_time(report(1e9, 5e8, {}), spec).bound == "memory"


def test_work_a_device_repeats_counts_from_its_compiled_program():
    """Under a layout that replicates work, the compiled program of one device does more than the step's
    FLOPs divided over the devices: the roofline takes the larger count."""
    spec = DeviceSpec(1e12, 1e12, 1e12)
    time = roofline.step_time(report(1e9, 1e6, {}, device_flops=4e9, device_bytes=3e6), spec)
    assert time.compute == pytest.approx(4e-3) and time.memory == pytest.approx(3e-6)


def test_one_table_serves_the_plan_and_throughput():
    assert roofline.device_spec("NVIDIA H100 80GB HBM3") == DeviceSpec(989e12, 3.35e12, 450e9)
    assert roofline.device_spec("cpu") is None
    for fragment, spec in roofline.DEVICE_SPECS:
        assert roofline.device_spec(fragment) == spec and peak_flops(fragment) == spec.peak_flops
