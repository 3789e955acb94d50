"""The work a jaxpr asks of its devices: FLOPs of its matrix products and convolutions, loops by their trip counts.

XLA's cost analysis of a program counts a `while` loop's body once, whatever
its trip count (a `lax.scan` of length 8 over a matmul counts one matmul; a
scan unrolled u times counts its u copies and the remainder), and a
`shard_map` body once, at one device's shapes. `jaxpr_work` walks the step's
jaxpr and counts the same matrix products and convolutions three ways
(`Work`): as the devices run them, as XLA's analysis of the lowered program
sees them, and as the devices run them but with loops as XLA counts them, so
that `meshfit.cost.step_report` can add to XLA's counts of the lowered
program and of one device's compiled program what each left out. Elementwise
work is not counted here (in a model it is a small share): it stays as XLA
counts it, loop bodies once.

Inside a `shard_map` it also finds work a device runs for nothing: a value
that every device computes but that a `select_n` (`jnp.where`) keyed to the
device's position on a manual mesh axis (`lax.axis_index`) keeps on some
devices only. A pipeline's tail (the layers after `Stages` and the loss) run
on every stage and kept on the last with `jnp.where(stage == P - 1, ...)`, as
the 1f1b loop first ran it, is (P - 1) / P `Work.redundant`; a `cond` keyed
to the position the same way (`lax.cond(stage == P - 1, ...)`) runs each
branch only where it is taken, and counts so.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from jax.extend import core as jax_core


class Work(NamedTuple):
    """FLOPs of a program's matrix products and convolutions (2 per multiply-add), over all its devices.

    Attributes:
        run: what the devices run: every loop's body times its trip count (a `scan`'s length; a
            `while`'s where its trip count is static, else once), a `shard_map` body once per device
            (at that device's shapes), the costliest branch of a `cond` (the branch each device takes
            where the index is the device's position on a manual axis). Dead code is left out.
        xla: as XLA's cost analysis of the lowered program counts them: a loop's body as often as
            the lowered program writes it out (once, or its `unroll` copies and the remainder), a
            `shard_map` body once, the costliest branch of a `cond`.
        xla_trips: as `run`, but loops counted as `xla` counts them: `run - xla_trips` is the work of
            the trips XLA's count of a compiled program leaves out, over all devices.
        redundant: the part of `run` whose results the devices that run it throw away (in a
            `shard_map`, a `select_n` keyed to the device's position keeps them elsewhere).
    """

    run: float
    xla: float
    xla_trips: float
    redundant: float


def jaxpr_work(jaxpr: jax_core.ClosedJaxpr | jax_core.Jaxpr) -> Work:
    """The `Work` of a (closed) jaxpr with every output used."""
    jaxpr = _open(jaxpr)
    place = _Place.outside()
    counted, _ = _walk(jaxpr, place, [None] * len(jaxpr.invars), [place.run] * len(jaxpr.outvars))
    return Work(*(float(x) for x in counted))


# -- where a jaxpr runs --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Place:
    """The devices a jaxpr runs on: one position outside a `shard_map` (global shapes); inside, one per
    device of its manual axes (`coords`: each axis's coordinate at each position), `run` marking those
    that run it (all, or where a `cond` keyed to the position takes this branch)."""

    sizes: dict[str, int]
    coords: dict[str, np.ndarray]
    run: np.ndarray

    @staticmethod
    def outside() -> _Place:
        return _Place({}, {}, np.ones(1, bool))

    @staticmethod
    def manual(mesh: Any, axes: Any) -> _Place:
        sizes = {a: int(mesh.shape[a]) for a in mesh.axis_names if a in axes}
        grid = np.indices(tuple(sizes.values()), dtype=np.int64).reshape(len(sizes), -1)
        coords = dict(zip(sizes, grid, strict=True))
        return _Place(sizes, coords, np.ones(grid.shape[1] if sizes else 1, bool))

    def where(self, run: np.ndarray) -> _Place:
        return dataclasses.replace(self, run=run)


# -- the walk --------------------------------------------------------------------------------------

_Known = dict  # var -> np.ndarray (positions,): the value every element of the var holds at each position
_ZERO = np.zeros(4)


def _walk(
    jaxpr: jax_core.Jaxpr, place: _Place, known_in: Sequence[np.ndarray | None], need_out: Sequence[np.ndarray]
) -> tuple[np.ndarray, list[np.ndarray]]:
    """(run, xla, xla_trips, redundant) of `jaxpr` at `place`, and where each input is needed.

    `known_in`: per input, its value at each position where that is known (None where not);
    `need_out`: per output, the positions that use it.
    """
    known = _forward(jaxpr, place, known_in)
    nowhere = np.zeros_like(place.run)
    need: dict = {}
    for var, mask in zip(jaxpr.outvars, need_out, strict=True):
        if isinstance(var, jax_core.Var):
            need[var] = need[var] | mask if var in need else mask
    total = _ZERO.copy()
    for eqn in reversed(jaxpr.eqns):
        out_need = [need.get(v, nowhere) for v in eqn.outvars]
        used = np.logical_or.reduce(out_need) if out_need else nowhere
        if eqn.effects:
            used = place.run
        if not used.any():
            continue  # dead code: XLA removes it
        counted, in_need = _eqn(eqn, place, known, out_need, used)
        total += counted
        for var, mask in zip(eqn.invars, in_need, strict=True):
            if isinstance(var, jax_core.Var):
                need[var] = need[var] | mask if var in need else mask
    return total, [need.get(v, nowhere) for v in jaxpr.invars]


def _eqn(
    eqn: Any, place: _Place, known: _Known, out_need: list[np.ndarray], used: np.ndarray
) -> tuple[np.ndarray, list[np.ndarray]]:
    """What one equation counts (its own FLOPs and its sub-programs'), and where its inputs are needed."""
    name, params = eqn.primitive.name, eqn.params
    flops = _own_flops(eqn)
    runs = float(np.count_nonzero(place.run))
    counted = np.array([flops * runs, flops, flops * runs, flops * np.count_nonzero(place.run & ~used)])
    in_need = [used] * len(eqn.invars)
    values = [_value(v, known, place) for v in eqn.invars]
    if name == "select_n" and values[0] is not None:  # each case is needed where the predicate picks it
        in_need = [used] + [used & (values[0] == k) for k in range(len(eqn.invars) - 1)]
    elif name == "scan":
        consts = params["num_consts"]
        body = _open(params["jaxpr"])
        inner, _ = _walk(
            body, place, values[:consts] + [None] * (len(body.invars) - consts), [used] * len(body.outvars)
        )
        length = params["length"]
        copies = _unrolled(length, params.get("unroll", 1))
        counted += inner * np.array([length, copies, copies, length])
    elif name == "while":
        cond_consts, body_consts = params["cond_nconsts"], params["body_nconsts"]
        cond, body = _open(params["cond_jaxpr"]), _open(params["body_jaxpr"])
        carries = values[cond_consts + body_consts :]
        trips = _while_trips(eqn, values)
        body_known = values[cond_consts : cond_consts + body_consts] + [None] * len(carries)
        inner, _ = _walk(body, place, body_known, [used] * len(body.outvars))
        counted += inner * np.array([trips, 1, 1, trips])
        counted += _walk(cond, place, values[:cond_consts] + [None] * len(carries), [used])[0]
    elif name == "cond":
        counted += _cond(eqn, place, values, used)
    elif name == "shard_map":
        inner_place = _Place.manual(params["mesh"], params.get("newly_manual_axes") or params.get("axis_names", ()))
        body = _open(params["jaxpr"])
        inner, _ = _walk(body, inner_place, [None] * len(body.invars), [inner_place.run] * len(body.outvars))
        counted += inner * np.array([runs, 1, runs, runs])  # XLA's lowered count: the body once, one device's shapes
    else:
        subs = _sub_jaxprs(params)
        if len(subs) == 1 and _call_like(subs[0], eqn):  # a call (jit, checkpoint, custom_jvp/vjp): inputs map 1:1
            inner, in_need = _walk(subs[0], place, values, out_need)
            counted += inner
        else:
            for sub in subs:
                counted += _walk(sub, place, [None] * len(sub.invars), [used] * len(sub.outvars))[0]
    return counted, in_need


def _cond(eqn: Any, place: _Place, values: list, used: np.ndarray) -> np.ndarray:
    """A `cond`: each branch where it is taken when the index is known per position; else the costliest,
    as XLA counts it (`xla` is the costliest branch either way)."""
    branches = [_open(b) for b in eqn.params["branches"]]
    index, operands = values[0], values[1:]
    counts = []
    for k, branch in enumerate(branches):
        taken = place.run if index is None else place.run & (np.clip(index, 0, len(branches) - 1) == k)
        counts.append(_walk(branch, place.where(taken), operands, [used] * len(branch.outvars))[0])
    if index is None:
        return np.max(counts, axis=0) if counts else _ZERO.copy()
    total = np.sum(counts, axis=0)
    total[1] = max(c[1] for c in counts)
    return total


def _unrolled(length: int, unroll: Any) -> int:
    """How many copies of a scan's body the lowered program writes out: `unroll` in the loop and the
    remainder after it (all of them when `unroll` covers the length)."""
    u = length if unroll is True else max(int(unroll or 1), 1)
    return length if u >= length else u + length % u


def _while_trips(eqn: Any, values: list) -> int:
    """A `while`'s trip count where it is static: the condition `i < n` (or `<=`) on a carry `i` that
    starts at a known value and grows by 1 a trip, `n` a literal, a known constant or a carry the body
    passes on unchanged; else 1 (the body once, as XLA counts it)."""
    params = eqn.params
    cond_consts, body_consts = params["cond_nconsts"], params["body_nconsts"]
    cond, body = _open(params["cond_jaxpr"]), _open(params["body_jaxpr"])
    carries = values[cond_consts + body_consts :]
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name not in ("lt", "le"):
        return 1
    test = cond.eqns[0]
    counter, bound = test.invars
    positions = {id(v): i for i, v in enumerate(cond.invars)}
    if id(counter) not in positions or positions[id(counter)] < cond_consts:
        return 1
    k = positions[id(counter)] - cond_consts
    if isinstance(bound, jax_core.Literal):
        limit: Any = np.asarray(bound.val)
    elif id(bound) in positions and positions[id(bound)] < cond_consts:
        limit = values[positions[id(bound)]]
    elif id(bound) in positions:
        j = positions[id(bound)] - cond_consts
        passed_on = body.outvars[j] is body.invars[body_consts + j]
        limit = carries[j] if passed_on else None
    else:
        limit = None
    start = carries[k]
    step = next((e for e in body.eqns if e.outvars[0] is body.outvars[k]), None)
    counter_in = body.invars[body_consts + k]
    if limit is None or start is None or step is None or step.primitive.name != "add":
        return 1
    if not any(v is counter_in for v in step.invars) or not any(
        isinstance(v, jax_core.Literal) and np.asarray(v.val) == 1 for v in step.invars
    ):
        return 1
    limit, start = np.unique(limit), np.unique(start)
    if limit.size != 1 or start.size != 1:
        return 1
    return max(int(limit[0]) - int(start[0]) + (test.primitive.name == "le"), 0)


# -- values known at each position: the device's place on a manual axis, and what follows from it ---------

_UNARY = {"neg": np.negative, "not": np.invert, "abs": np.abs, "sign": np.sign}
_BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "rem": np.fmod,
}
_SAME = {"pvary", "copy", "copy_p", "broadcast_in_dim", "reshape", "squeeze", "expand_dims"}


def _forward(jaxpr: jax_core.Jaxpr, place: _Place, known_in: Sequence[np.ndarray | None]) -> _Known:
    """The values known at each position: literals, `axis_index` of a manual axis, and scalar arithmetic
    on them (a value is known when all its elements are equal at each position)."""
    known: _Known = {v: k for v, k in zip(jaxpr.invars, known_in, strict=True) if k is not None}
    for eqn in jaxpr.eqns:
        values = [_value(v, known, place) for v in eqn.invars]
        outs = _evaluate(eqn, values, place)
        for var, value in zip(eqn.outvars, outs, strict=True):
            if value is not None and isinstance(var, jax_core.Var):
                known[var] = value
    return known


def _evaluate(eqn: Any, values: list, place: _Place) -> list:
    name, params = eqn.primitive.name, eqn.params
    nothing: list = [None] * len(eqn.outvars)
    if name == "axis_index":
        axes = params["axis_name"] if isinstance(params["axis_name"], tuple) else (params["axis_name"],)
        if not all(a in place.coords for a in axes):
            return nothing
        index = np.zeros_like(place.run, dtype=np.int64)
        for a in axes:
            index = index * place.sizes[a] + place.coords[a]
        return [index]
    if not values or any(v is None for v in values):
        subs = _sub_jaxprs(params)
        if len(subs) == 1 and _call_like(subs[0], eqn) and any(v is not None for v in values):
            inner = _forward(subs[0], place, values)
            return [inner.get(v) if isinstance(v, jax_core.Var) else _value(v, inner, place) for v in subs[0].outvars]
        return nothing
    try:
        with np.errstate(all="ignore"):
            if name in _SAME:
                return [values[0]]
            if name == "convert_element_type":
                return [values[0].astype(np.dtype(params["new_dtype"]))]
            if name in _UNARY:
                return [_UNARY[name](values[0])]
            if name in _BINARY:
                return [_BINARY[name](values[0], values[1])]
            if name == "select_n":
                return [np.choose(values[0].astype(np.int64), values[1:])]
            if name == "clamp":
                return [np.clip(values[1], values[0], values[2])]
    except (TypeError, ValueError):
        return nothing
    subs = _sub_jaxprs(params)
    if len(subs) == 1 and _call_like(subs[0], eqn):
        inner = _forward(subs[0], place, values)
        return [inner.get(v) if isinstance(v, jax_core.Var) else _value(v, inner, place) for v in subs[0].outvars]
    return nothing


def _value(var: Any, known: _Known, place: _Place) -> np.ndarray | None:
    if isinstance(var, jax_core.Literal):
        value = np.asarray(var.val)
        return np.full(place.run.shape, value, value.dtype) if value.ndim == 0 else None
    return known.get(var)


# -- small helpers -----------------------------------------------------------------------------------


def _own_flops(eqn: Any) -> float:
    """2 per multiply-add of a matrix product or convolution; 0 for anything else."""
    name = eqn.primitive.name
    if name == "dot_general":
        lhs = eqn.invars[0].aval
        (contracting, _), _ = eqn.params["dimension_numbers"]
        out = eqn.outvars[0].aval
        return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contracting)
    if name == "conv_general_dilated":
        rhs, out = eqn.invars[1].aval, eqn.outvars[0].aval
        out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * math.prod(out.shape) * math.prod(rhs.shape) / out_features
    return 0.0


def _open(jaxpr: Any) -> jax_core.Jaxpr:
    return getattr(jaxpr, "jaxpr", jaxpr)


def _sub_jaxprs(params: dict) -> list[jax_core.Jaxpr]:
    """The jaxprs among an equation's parameters (a `custom_vjp_call`'s primal only: its forward and
    backward are functions, traced where a gradient is taken, so a loop in them is found once)."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (jax_core.ClosedJaxpr, jax_core.Jaxpr)):
                found.append(_open(item))
    return found


def _call_like(sub: jax_core.Jaxpr, eqn: Any) -> bool:
    return len(sub.invars) == len(eqn.invars) and len(sub.outvars) == len(eqn.outvars)
