"""The few places meshfit reaches into a library's private code, each with why.

Keep every such use here, so a version bump has one file to check.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Callable
from typing import Any


def as_eager(fn):
    """`fn` (no arguments) as a function that, traced into one program, computes what eager JAX computes.

    `fn` is traced to a jaxpr whose top-level equations are replayed one by
    one, each one's results behind `lax.optimization_barrier`: XLA then cannot
    simplify across equations as it does inside one program (it folds
    `normal(key) * stddev` into one multiply by a different constant, 1 ulp
    away), nor evaluate them at compile time with its own math (`erf` of a
    literal bound), while each equation, a jitted library function included,
    is compiled as eager execution compiles it. Why: a model created from a
    factory inside `jax.jit` (to create it in its sharded layout) must start
    bitwise equal to the same module created eagerly. The replay uses JAX's
    jaxpr internals (`get_bind_params`, whose result changed shape across versions).
    """
    import jax
    from jax.extend import core as jax_core

    closed, shapes = jax.make_jaxpr(fn, return_shape=True)()
    treedef = jax.tree.structure(shapes)

    def fence(value, dtype=None):
        value = jax.numpy.asarray(value, dtype)
        return value if jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended) else jax.lax.optimization_barrier(value)

    def replay():
        # Constants reach each equation as eager execution passes them, as values computed at run
        # time: XLA would fold them at compile time, with its own (differently rounded) math.
        env = {var: fence(const) for var, const in zip(closed.jaxpr.constvars, closed.consts, strict=True)}

        def read(var):
            return fence(var.val, var.aval.dtype) if isinstance(var, jax_core.Literal) else env[var]

        for eqn in closed.jaxpr.eqns:
            params = eqn.primitive.get_bind_params(eqn.params)
            subfuns, params = params if isinstance(params, tuple) else ((), params)
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **params)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
            plain = [i for i, out in enumerate(outs) if not jax.dtypes.issubdtype(out.dtype, jax.dtypes.extended)]
            fenced = jax.lax.optimization_barrier([outs[i] for i in plain])  # not for key arrays
            for i, out in zip(plain, fenced, strict=True):
                outs[i] = out
            env.update(zip(eqn.outvars, outs, strict=True))
        return jax.tree.unflatten(treedef, [read(var) for var in closed.jaxpr.outvars])

    return replay


def key_impl(leaf):
    """The PRNG implementation of a typed key array, or of a template's key (a `jax.ShapeDtypeStruct`).

    `jax.random.key_impl` takes arrays only; a restore into a template (a model
    not created yet) must wrap the saved key data with the template's
    implementation, which a key dtype keeps in `_impl`.
    """
    import jax

    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf.dtype._impl
    return jax.random.key_impl(leaf)


def cluster_environments() -> list:
    """JAX's registry of cluster environments (SLURM, Open MPI, Cloud TPU, Kubernetes, ...).

    Why: `jax.distributed.initialize` detects them, but JAX exposes no public
    way to ask which one it would pick; meshfit names it in its messages.
    """
    from jax._src import clusters

    return list(clusters.ClusterEnv._cluster_types)


def detect_cluster_settings(coordinator_address, num_processes, process_id, local_device_ids, timeout) -> tuple:
    """The settings JAX's cluster auto-detection (SLURM, Open MPI, Cloud TPU, Kubernetes) fills where unset.

    Returns (coordinator_address, num_processes, process_id, local_device_ids),
    exactly what `jax.distributed.initialize` would use. Why: meshfit's start-up
    handshake (`meshfit.runtime.rendezvous`) meets on the coordinator's port before
    JAX joins the job, so it needs these first; JAX runs its detection only
    inside `initialize`.
    """
    from jax._src import clusters

    return clusters.ClusterEnv.auto_detect_unset_distributed_params(
        coordinator_address, num_processes, process_id, local_device_ids, None, timeout
    )


def backends_are_initialized() -> bool:
    """Whether JAX's backend has started (then `jax.distributed.initialize` refuses to run).

    Why: `meshfit.runtime.cluster.initialize` checks it before its start-up handshake,
    so that a process that cannot join refuses at once instead of letting the
    others go on to wait for it.
    """
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def preemption_sync_manager():
    """JAX's preemption sync manager of this process's `jax.distributed` job, or None.

    Why: `multihost_utils.reached_preemption_sync_point` fails when no manager
    was started; meshfit asks first, so a job without one falls back to its
    own SIGTERM handler.
    """
    from jax._src import distributed

    return distributed.global_state.preemption_sync_manager


#: Seconds process 0 waits at exit for its coordination service to stop before leaving it to the process's exit.
COORDINATION_SHUTDOWN_GRACE = 1.0


class _BoundedServiceShutdown:
    """Stands in for JAX's coordination service so that its `shutdown()` waits at most about `grace` seconds."""

    def __init__(self, service, grace: float, port: int | None = None):
        self.service, self.grace, self.port = service, grace, port

    def shutdown(self) -> None:
        stopper = threading.Thread(target=self.service.shutdown, daemon=True, name="meshfit-coordination-shutdown")
        stopper.start()
        stopper.join(self.grace)
        if stopper.is_alive() and self.port is not None and _cut_connections_to(self.port):
            stopper.join(self.grace)  # the service ends once no connection holds it
        if stopper.is_alive():
            import logging

            logging.getLogger("meshfit.runtime.cluster").warning(
                "The coordination service still held a connection that is not one of the job's %.1f s after the "
                "job ended; exiting without waiting for it (its sockets close with this process).",
                self.grace,
            )


def _cut_connections_to(port: int) -> int:
    """Shuts down this process's accepted TCP connections on local port `port`; returns how many.

    At exit, after the job's shutdown barrier, every job process has left the coordination service: a
    connection still open on its port is not one of the job's (a silent stranger), and it alone holds the
    service's shutdown. Left to the process's own end, the shutdown's thread could return into an interpreter
    that is finalising, which aborts the process (SIGABRT) after the job succeeded.
    """
    import socket

    cut = 0
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            conn = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue
        try:
            if conn.type == socket.SOCK_STREAM and conn.family in (socket.AF_INET, socket.AF_INET6):
                if conn.getsockname()[1] == port:
                    conn.getpeername()  # a connection, not the listening socket (which has no peer)
                    conn.shutdown(socket.SHUT_RDWR)
                    cut += 1
        except OSError:
            pass
        finally:
            conn.close()
    return cut


def bound_coordination_shutdown(grace: float = COORDINATION_SHUTDOWN_GRACE, port: int | None = None) -> None:
    """Makes this process's `jax.distributed` shutdown wait at most `grace` seconds for its coordination service.

    Why: process 0 runs the job's coordination service, whose shutdown (run by
    JAX at exit, after every process has passed the shutdown barrier) stops
    its gRPC server with a 5 s deadline (`xla/pjrt/distributed/service.cc`);
    a connection that is not one of the job's and never speaks holds that
    deadline to its end, so any local process could make every job exit 5 s
    late. The job's own calls are answered in milliseconds; past `grace` the
    connections still open on the service's `port` are cut (none is the
    job's any more) and the shutdown gets `grace` more; past that the server
    is left to the process's exit. JAX keeps the service in
    `global_state.service` and calls only its `shutdown()`. No-op in a
    process without the service.
    """
    from jax._src import distributed

    service = distributed.global_state.service
    if service is not None and not isinstance(service, _BoundedServiceShutdown):
        distributed.global_state.service = _BoundedServiceShutdown(service, grace, port)


def release_orbax_waiters() -> int:
    """Ends Orbax's background threads left waiting for a save that failed; returns how many.

    Why: when a save fails in its synchronous part (the directory became
    read-only), Orbax 0.11-0.12 leaves non-daemon `_SignalingThread`s waiting
    for "directory created" signals that will never be set, with a timeout of
    many minutes: the interpreter cannot exit until they give up. Cancelling a
    thread and setting the signals it waits for lets it return at once. Only
    called after a failed save, when nothing of that save should proceed.
    """
    try:
        from orbax.checkpoint._src.futures import future
    except ImportError:  # another Orbax layout: nothing known to release
        return 0
    thread_type = getattr(future, "_SignalingThread", None)
    if thread_type is None:
        return 0
    released = 0
    for thread in threading.enumerate():
        if isinstance(thread, thread_type) and thread.is_alive():
            thread.cancel()
            try:
                future.set_signals(thread._receive_signals, operation_id=thread._operation_id)
            except Exception:  # noqa: BLE001 - best effort: the thread still times out by itself
                continue
            released += 1
    return released


def compilations(jitted) -> int:
    """How many executables a `jax.jit` function holds (one per argument shape it met); 0 for other callables.

    Private: `_cache_size` is the jit wrapper's own count; JAX has no public one.
    """
    size = getattr(jitted, "_cache_size", None)
    return size() if callable(size) else 0


@dataclasses.dataclass(frozen=True)
class VjpResiduals:
    """Where the function `jax.vjp(fn, params, *args)` returns keeps its residuals, so a loop can keep them apart.

    `jax.vjp` returns its backward function as a pytree (a `jax.tree_util.Partial`)
    whose leaves are the residuals the backward pass reads; among them, as the very
    arrays passed in, are the leaves of `params` it needs (a matmul's weight). The
    1F1B loop (`meshfit.pipeline.one_f_one_b`) runs one `fn` on one stage's `params`
    every tick and keeps each tick's residuals until that microbatch's backward:
    it stores only the leaves that are not `params`' own (`kept`) and puts the
    parameters back when it rebuilds the backward function (`rebuild`).

    Why here: both facts are JAX's implementation, not its documented API. If a
    release stops returning a pytree of arrays, `kept` and `rebuild` fail when the
    step is traced. If it copies or wraps the primal arrays, no residual is found
    to be a parameter: the numbers stay the same, but every slot of the stash
    keeps a copy of the stage's parameters (what
    `tests/pipeline/test_pipeline_schedules.py` measures).

    Attributes:
        treedef: the structure of the backward function.
        primal: for each of its leaves, the index of the `params` leaf it is, or None.
        kept_shapes: the shapes and dtypes of the other leaves, in order: what a stash keeps.
    """

    treedef: Any
    primal: tuple[int | None, ...]
    kept_shapes: tuple[Any, ...]

    def kept(self, vjp_fn: Any) -> list:
        """The leaves of a backward function of `fn` that are not `params`' own: what a stash keeps."""
        import jax

        leaves = jax.tree.leaves(vjp_fn)
        if len(leaves) != len(self.primal):  # (the structures hold each call's own program: not compared)
            raise ValueError(
                f"A backward function of `fn` holds {len(leaves)} residuals; the one traced first held "
                f"{len(self.primal)}. Call `kept` with a backward function of the `fn` and `params` traced."
            )
        return [leaf for leaf, index in zip(leaves, self.primal, strict=True) if index is None]

    def rebuild(self, params: Any, kept: list) -> Callable:
        """The backward function of `fn` on `params` from the leaves `kept` returned."""
        import jax

        param_leaves, rest = jax.tree.leaves(params), iter(kept)
        leaves = [next(rest) if index is None else param_leaves[index] for index in self.primal]
        return jax.tree.unflatten(self.treedef, leaves)


def vjp_residuals(fn: Callable, params: Any, *args: Any) -> VjpResiduals:
    """How `jax.vjp(fn, params, *args)` holds its residuals (`VjpResiduals`), traced once, nothing computed.

    A residual is one of `params`' leaves where the traced program returns that
    input itself (the jaxpr's output variable is the input's).
    """
    import jax
    from jax.extend import core as jax_core

    closed, vjp_shape = jax.make_jaxpr(lambda p, *a: jax.vjp(fn, p, *a)[1], return_shape=True)(params, *args)
    inputs = {id(var): index for index, var in enumerate(closed.jaxpr.invars[: len(jax.tree.leaves(params))])}
    primal = tuple(inputs.get(id(var)) if isinstance(var, jax_core.Var) else None for var in closed.jaxpr.outvars)
    shapes = jax.tree.leaves(vjp_shape)
    kept_shapes = tuple(shape for shape, index in zip(shapes, primal, strict=True) if index is None)
    return VjpResiduals(jax.tree.structure(vjp_shape), primal, kept_shapes)


@functools.cache
def fix_nested_shard_map_residuals() -> bool:
    """Makes `jax.shard_map` differentiable inside another one's manual region (context attention in a pipeline).

    When autodiff or `lax.scan` splits a shard_map's body in two, JAX hands the
    residuals across in a spec built from every mesh axis the value varies over
    (`ShapedArray.nospec`), the enclosing map's manual axes included. Nested in
    the pipeline's loop (manual over `stage` and data axes), the inner map over
    `context` then names axes it cannot split, and Shardy refuses the program
    ("all manual axes come before free axes", or a local shape mismatch). The
    residuals belong to the inner map's own axes only (`all_names`; the caller's
    stay manual around it): this keeps those, as JAX does already when
    `check_vma=False`. Applied once (a second application would filter again,
    to the same spec). Returns whether the fix is in place (False on a JAX
    without the method, whose errors then show at the step's compile).
    """
    from jax._src import core

    original = getattr(core.ShapedArray, "nospec", None)
    if original is None:
        return False

    def nospec(self, mesh, check_vma, all_names):
        spec = original(self, mesh, check_vma, all_names)
        if not check_vma or not spec:
            return spec
        varying = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])
        names = tuple(name for name in varying if name in all_names)
        dims = (names,) if names else ()
        return type(spec)(*dims, unreduced=spec.unreduced, reduced=spec.reduced)

    core.ShapedArray.nospec = nospec
    return True


def keras_layers(keras_model: Any) -> list:
    """Every layer inside a Keras model, nested ones included (not the model itself).

    Keras 3 lists a model's layers recursively only through its private `_flatten_layers` (`model.layers` holds
    the direct ones); meshfit reads it to check that each is built and can run compiled before training starts.
    """
    return list(keras_model._flatten_layers(include_self=False, recursive=True))
