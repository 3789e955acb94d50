"""`meshfit plan MODULE:FACTORY --batch-size ...`: `meshfit.plan`'s table from the command line.

Free of JAX until the command runs, so that `--host-devices` can simulate CPU
devices before JAX starts and `meshfit launch` does not pay for it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
from typing import Any

EXAMPLE = (
    "meshfit plan examples/transformer_lm.py:plan_factory --rules examples/transformer_lm.py:PLAN_RULES "
    "--x 64:int32 --y 64:int32 --loss sparse_categorical_crossentropy --batch-size 32 64"
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the `plan` subcommand to the `meshfit` parser."""
    parser = sub.add_parser(
        "plan",
        help="compile the train step for every layout and print which fit and which is fastest",
        description="Compile a model's train step for every layout of the devices (Mirrored, each data x "
        "fsdp x tensor mesh, and for a model on meshfit.pipeline.Stages stage x data meshes with each pipeline "
        "schedule that fits: gpipe, 1f1b, circular), batch size and remat choice, without creating its "
        "parameters, and print the "
        f"table of meshfit.plan. Example: {EXAMPLE}",
    )
    parser.add_argument("factory", metavar="MODULE:FACTORY", help="a function returning a flax.nnx.Module")
    parser.add_argument("--batch-size", type=int, nargs="+", required=True, help="global batch sizes")
    parser.add_argument("--x", required=True, metavar="SHAPE:DTYPE", help="one input row, e.g. 64:int32 or 28,28:f32")
    parser.add_argument("--y", required=True, metavar="SHAPE:DTYPE", help="one target row, e.g. :int32 (a label)")
    parser.add_argument("--loss", required=True, help="a loss name, as Model.compile takes it")
    parser.add_argument("--optimizer", default="adam", help="an optimizer name (default adam)")
    parser.add_argument("--rules", metavar="MODULE:NAME", help="MeshStrategy rules: a list of (regex, spec)")
    parser.add_argument("--devices", type=int, help="plan for the first N devices (default all)")
    parser.add_argument("--memory-limit", help="bytes per device, e.g. 16GiB (default: what the device reports)")
    parser.add_argument(
        "--device-spec",
        metavar="FLOPS,BYTES/S,BYTES/S",
        help="the device's peak FLOP/s, memory and interconnect bandwidth, e.g. 989e12,3.35e12,450e9 "
        "(default: meshfit.cost.roofline.DEVICE_SPECS)",
    )
    parser.add_argument(
        "--measure",
        type=int,
        default=0,
        metavar="K",
        help="time the K best-predicted candidates that fit with a few real steps each (creating their "
        "parameters, one candidate at a time) and rank those by the time measured (default 0: none; the "
        "roofline's step time is a lower bound)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar on stderr (it names the candidate being compiled)"
    )
    parser.add_argument(
        "--host-devices", type=int, default=0, help="simulate N CPU devices (when XLA_FLAGS is not set)"
    )


def run(args: argparse.Namespace) -> int:
    """Plans as the arguments say and prints the table."""
    if args.measure < 0:
        raise ValueError(f"--measure takes how many candidates to time, an int >= 0. Received: {args.measure}.")
    if args.host_devices > 0 and "XLA_FLAGS" not in os.environ and "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.host_devices}"
    import jax  # noqa: PLC0415  (after XLA_FLAGS)
    import numpy as np  # noqa: PLC0415

    from meshfit.cost.roofline import DeviceSpec  # noqa: PLC0415
    from meshfit.planning.planner import plan  # noqa: PLC0415

    devices = jax.devices()
    if args.devices is not None:
        if not 0 < args.devices <= len(devices):
            raise ValueError(f"--devices must be between 1 and {len(devices)}. Received: {args.devices}.")
        devices = devices[: args.devices]
    x_shape, x_dtype = row(args.x, "--x")
    y_shape, y_dtype = row(args.y, "--y")
    result = plan(
        load(args.factory, "MODULE:FACTORY"),
        np.zeros((1, *x_shape), x_dtype),
        np.zeros((1, *y_shape), y_dtype),
        compile={"optimizer": args.optimizer, "loss": args.loss},
        devices=devices,
        memory_limit=None if args.memory_limit is None else byte_count(args.memory_limit),
        batch_sizes=args.batch_size,
        rules=() if args.rules is None else load(args.rules, "--rules"),
        device_spec=None if args.device_spec is None else DeviceSpec(*peaks(args.device_spec)),
        measure=args.measure,
        verbose=0 if args.quiet else 1,
    )
    print(result)
    return 0


def load(target: str, what: str) -> Any:
    """The object `NAME` of `MODULE:NAME`: MODULE a dotted module name (from the current directory too) or a
    path to a .py file."""
    module_name, _, name = target.rpartition(":")
    if not module_name or not name:
        raise ValueError(f"{what} must be MODULE:NAME (a module or a .py file, then a name). Received: {target!r}.")
    if module_name.endswith(".py") or os.sep in module_name:
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(module_name))[0], module_name)
        if spec is None or not os.path.exists(module_name):
            raise ValueError(f"{what}: no Python file at {module_name!r}. Received: {target!r}.")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise ValueError(f"{what}: {module_name!r} has no {name!r}. Received: {target!r}.")
    return getattr(module, name)


def row(text: str, what: str) -> tuple[tuple[int, ...], str]:
    """`(shape, dtype)` of one row from `SHAPE:DTYPE`, e.g. "64:int32", "28,28:float32" or ":int32"."""
    shape, _, dtype = text.rpartition(":")
    if ":" not in text or not dtype or not re.fullmatch(r"([0-9]+(,[0-9]+)*)?", shape):
        raise ValueError(f"{what} takes SHAPE:DTYPE, e.g. 64:int32, 28,28:float32 or :int32. Received: {text!r}.")
    return tuple(int(d) for d in shape.split(",") if d), dtype


def byte_count(text: str) -> int:
    """Bytes from "1000000", "512MiB", "16GiB", "2.5GB"."""
    match = re.fullmatch(r"([0-9.]+)\s*([KMGT]i?B)?", text.strip())
    if not match:
        raise ValueError(f"--memory-limit takes bytes, e.g. 16GiB, 512MiB or 1000000. Received: {text!r}.")
    units = {None: 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    units["TiB"] = 2**40
    return int(float(match[1]) * units[match[2]])


def peaks(text: str) -> tuple[float, float, float]:
    """`(peak FLOP/s, memory bytes/s, interconnect bytes/s)` from "989e12,3.35e12,450e9"."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or any(v <= 0 for v in values):
        raise ValueError(
            "--device-spec takes three positive numbers: peak FLOP/s, memory and interconnect bytes/s, "
            f"e.g. 989e12,3.35e12,450e9. Received: {text!r}."
        )
    return values
