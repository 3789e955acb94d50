"""The `meshfit` command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from meshfit import __version__
from meshfit.launch.local import GRACE_SECONDS, PREEMPTION_GRACE_SECONDS, LaunchConfig, launch
from meshfit.launch.ray import ELASTIC_WAIT
from meshfit.planning import command as plan_command
from meshfit.runtime.job_layout import LAUNCHERS, DistributedJob, JobLayout


def _launchers() -> list[ModuleType]:
    """The modules that add a kind of job to `meshfit launch` (`job_layout.LAUNCHERS`), each free of JAX."""
    return [importlib.import_module(name) for name in LAUNCHERS]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshfit", description="meshfit command line tools.")
    parser.add_argument("--version", action="version", version=f"meshfit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "launch",
        help="run a multi-process JAX job on this machine",
        description="Start N processes of a script, wired to a coordinator on 127.0.0.1, as one JAX job.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument("--nprocs", type=int, default=None, help="number of processes")
    run.add_argument(
        "--devices-per-proc",
        type=int,
        default=None,
        help="devices per process: simulated CPU devices, or a slice of the GPUs",
    )
    run.add_argument(
        "--max-restarts", type=int, default=0, help="start the whole job again up to this many times after a failure"
    )
    run.add_argument(
        "--min-nprocs",
        type=int,
        default=None,
        help="elastic restarts, down to this many processes (BackupAndRestore resumes onto the smaller job, from "
        "memory when the state is replicated): on this machine, a rank that fails within seconds of a restart is "
        "dropped; with --ray, a restart whose ranks the cluster cannot all place within --elastic-wait (a node "
        "gone for good) runs as many as it can place; default: --nprocs",
    )
    run.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=10,
        help="seconds without heartbeats after which a process is declared dead",
    )
    run.add_argument(
        "--grace-period",
        type=float,
        default=PREEMPTION_GRACE_SECONDS,
        help="seconds the ranks get to write their preemption backups after the launcher receives "
        "SIGTERM, SIGINT or SIGHUP; what is left is then killed",
    )
    run.add_argument(
        "--stop-grace",
        type=float,
        default=GRACE_SECONDS,
        help="seconds the other ranks get to end once the ranks the job needs finished before they are killed "
        "(after a rank failed: at most 0.5 s, as the job's collectives are broken)",
    )
    run.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run the ranks as Ray actors on the Ray cluster at ADDRESS (without it: RAY_ADDRESS, a running "
        'local cluster, else a new local one); needs `pip install "meshfit[ray]"`. Run the cluster with '
        "RAY_AUTH_MODE=token and the nodes on a private network: the ranks' own ports (meshfit's handshake, "
        "JAX's coordination service, gloo) listen unauthenticated on the node's address (docs/multi_host.md)",
    )
    run.add_argument(
        "--resources-per-proc",
        default=None,
        metavar="JSON",
        help='with --ray: the Ray resources of each rank, e.g. \'{"CPU": 4, "GPU": 1}\' (default {"CPU": 1})',
    )
    run.add_argument(
        "--placement",
        default="PACK",
        choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
        help="with --ray: the placement group's strategy for the ranks' bundles",
    )
    run.add_argument(
        "--elastic-wait",
        type=float,
        default=ELASTIC_WAIT,
        metavar="SECONDS",
        help="with --ray and --min-nprocs: seconds a restart waits for the cluster to place each number of "
        "ranks it tries, from --nprocs down",
    )
    run.add_argument(
        "--no-fork-server",
        dest="fork_server",
        action="store_false",
        help="start each rank as a new interpreter instead of forking it from the launch's fork server (which "
        "imports JAX, Flax, Optax, Orbax and meshfit once, and what the script imported, for every start)",
    )
    run.add_argument(
        "--verbose",
        action="store_true",
        help="pass on every line the processes print, also gloo's connection lines (dropped by default)",
    )
    for launcher in _launchers():
        launcher.add_arguments(run)
    run.add_argument("-m", dest="module", default=None, help="run a module (like python -m)")
    run.add_argument("script", nargs="?", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    plan_command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "plan":
        try:
            return plan_command.run(args)
        except ValueError as error:  # bad arguments, or no candidate compiled
            _parser().error(str(error))
    if args.command == "launch":
        if args.module:
            command = ["-m", args.module] + ([args.script] if args.script else []) + args.args
        elif args.script:
            command = [args.script] + args.args
        else:
            _parser().error("launch needs a script (or -m module) to run")
        config = LaunchConfig(
            command=command,
            layout=_layout(args),
            devices_per_proc=args.devices_per_proc,
            max_restarts=args.max_restarts,
            min_nprocs=args.min_nprocs,
            heartbeat_timeout=args.heartbeat_timeout,
            grace_period=args.grace_period,
            stop_grace=args.stop_grace,
            verbose=args.verbose,
            fork_server=args.fork_server,
        )
        try:
            return launch(config, runner=_ray_runner(args))
        except ValueError as error:  # a misconfiguration found before any process started
            _parser().error(str(error))
        except ImportError as error:  # --ray without Ray
            print(f"meshfit launch: {error}", file=sys.stderr)
            return 2
    return 2


def _ray_runner(args: argparse.Namespace):
    """With --ray, the runner that starts the ranks as Ray actors (`meshfit.launch.ray`); else None."""
    if args.ray is None:
        if args.resources_per_proc is not None:
            _parser().error(
                f"--resources-per-proc needs --ray. Received: --resources-per-proc {args.resources_per_proc}"
            )
        return None
    from meshfit.launch import ray as ray_launch

    try:
        resources = ray_launch.parse_resources(args.resources_per_proc) if args.resources_per_proc else {"CPU": 1}
    except ValueError as error:
        _parser().error(str(error))
    if args.elastic_wait <= 0:
        _parser().error(f"--elastic-wait expected a number of seconds above 0. Received: {args.elastic_wait:g}.")
    return ray_launch.RayRunner(ray_launch.RayOptions(args.ray or None, resources, args.placement, args.elastic_wait))


def _layout(args: argparse.Namespace) -> JobLayout:
    """The job the arguments ask for: the first launcher's whose arguments were given, else `--nprocs N`."""
    launchers = _launchers()
    for launcher in launchers:
        try:
            layout = launcher.layout(args)
        except ValueError as error:
            _parser().error(str(error))
        if layout is not None:
            return layout
    if args.nprocs is None:
        _parser().error("launch needs --nprocs N" + "".join(f", or {launcher.USAGE}" for launcher in launchers))
    return DistributedJob(args.nprocs)


if __name__ == "__main__":
    sys.exit(main())
