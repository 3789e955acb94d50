"""How each parameter is laid out on a mesh: rules, Flax metadata, then a default.

`resolve_specs` returns one `PartitionSpec` per parameter, decided in order by
  1. explicit `rules`: (regex searched in the parameter path, spec) pairs, first
     match wins — like Keras 3's `LayoutMap`;
  2. sharding metadata on the Flax variable (`nnx.with_partitioning`,
     `linen.with_logical_partitioning`), logical names mapped to mesh axes by
     `logical_axis_rules` (as MaxText and T5X do); unmapped names replicate;
  3. a default: parameters with at least `min_shard_size` elements are sharded
     on their largest dimension that divides by the `fsdp` axis; smaller ones
     are replicated.
A parameter of a `meshfit.pipeline.Stages` stack carries metadata whose first
entry is the `stage` axis (the second, after None, for a circular pipeline's
repeat-major stack): its layer axis is split over `stage` (kept whole on a
mesh without one) and its other dimensions follow the rest of its metadata, or
the default when that names no axis.
Every spec is checked against the mesh and the shape, with an error naming the
parameter, its shape and the rule.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshfit.core.trees import path_name
from meshfit.pipeline import layer_stacks
from meshfit.pipeline.settings import STAGE_AXIS

Rules = Sequence[tuple[str, Any]]


def is_layout_map(rules: Any) -> bool:
    """Whether `rules` is a `keras.distribution.LayoutMap` (looked for only where Keras is imported already)."""
    distribution = getattr(sys.modules.get("keras"), "distribution", None)
    layout_map = getattr(distribution, "LayoutMap", None)
    return isinstance(layout_map, type) and isinstance(rules, layout_map)


def rules_of(rules: Rules | Mapping[str, Any]) -> list[tuple[str, Any]]:
    """`rules` as `(regex, spec)` pairs; a mapping's items are pairs. A `keras.distribution.LayoutMap`'s items
    are rules on the same variable paths (`"sequential/dense/kernel"`, searched by regex): each key a regex, its
    `TensorLayout`'s `axes` the spec."""
    if not isinstance(rules, Mapping):
        return list(rules)
    if is_layout_map(rules):
        return [(pattern, tuple(tensor_layout.axes)) for pattern, tensor_layout in rules.items()]
    return list(rules.items())


def as_spec(spec) -> P:
    """A PartitionSpec from a spec, an axis name or a tuple, without trailing Nones.

    JAX reports layouts without trailing Nones, so a rule written with them
    must be normalised or the step's output layout would differ from its input's.
    """
    if isinstance(spec, str):
        spec = (spec,)
    entries = list(spec) if spec is not None else []
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def check_spec(spec: P, shape: tuple[int, ...], mesh: Mesh, name: str, source: str) -> P:
    """Raises a clear error if `spec` cannot lay out an array of `shape` on `mesh`."""
    if len(spec) > len(shape):
        raise ValueError(
            f"Parameter '{name}' with shape {shape} cannot use {source} {spec}: the spec has {len(spec)} "
            f"entries but the parameter has {len(shape)} dimensions."
        )
    used = []
    for dim, entry in enumerate(spec):
        axes = _axes_of(entry)
        unknown = [a for a in axes if a not in mesh.shape]
        if unknown:
            raise ValueError(
                f"Parameter '{name}' with shape {shape}: {source} {spec} names mesh axis {unknown[0]!r}, "
                f"but the mesh has axes {tuple(mesh.axis_names)}."
            )
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if shape[dim] % size:
            raise ValueError(
                f"Parameter '{name}' with shape {shape}: {source} {spec} splits dimension {dim} "
                f"(size {shape[dim]}) over {'x'.join(axes)} = {size} devices, which does not divide it. "
                "Change the rule or the mesh."
            )
        used += axes
    if len(set(used)) != len(used):
        raise ValueError(f"Parameter '{name}' with shape {shape}: {source} {spec} uses a mesh axis twice.")
    return spec


def map_logical(spec: P, logical_axis_rules: dict[str, Any], mesh: Mesh) -> P:
    """Maps logical axis names to mesh axes; names neither mapped nor on the mesh replicate."""

    def one(name):
        if name in logical_axis_rules:
            return logical_axis_rules[name]
        return name if name in mesh.shape else None

    out = []
    for entry in spec:
        if entry is None:
            out.append(None)
        elif isinstance(entry, str):
            out.append(one(entry))
        else:
            mapped = tuple(a for a in (one(e) for e in entry) if a is not None)
            out.append(mapped or None)
    return P(*out)


def default_spec(shape: tuple[int, ...], mesh: Mesh, fsdp_axis: str, min_shard_size: int) -> P:
    """Shards the largest dimension divisible by the fsdp axis; replicates small arrays."""
    size = mesh.shape.get(fsdp_axis, 1)
    if size == 1 or int(np.prod(shape)) < min_shard_size:
        return P()
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % size == 0:
            return P(*([None] * dim + [fsdp_axis]))  # no trailing Nones
    return P()


def stage_spec(hint: P, shape, mesh: Mesh, name: str, logical: dict, fsdp_axis: str, min_shard_size: int) -> P:
    """The spec of a stacked layer parameter: its layer axis over `stage` (the second of a repeat-major stack's
    two layer axes, `meshfit.pipeline.layer_stacks`), the rest by metadata or default."""
    lead = layer_stacks.layer_axes(hint)
    rest = P(*hint[lead:])
    if any(entry is not None for entry in rest):
        inner = tuple(map_logical(rest, logical, mesh))
    else:
        inner = tuple(default_spec(shape[lead:], mesh, fsdp_axis, min_shard_size))
    stage = STAGE_AXIS if STAGE_AXIS in mesh.shape else None
    layers = (None,) * (lead - 1) + (stage,)
    return check_spec(as_spec((*layers, *inner)), shape, mesh, name, f"its sharding metadata {hint} ->")


def resolve_specs(
    tree,
    mesh: Mesh,
    *,
    rules: Rules = (),
    hints=None,
    logical_axis_rules=None,
    fsdp_axis: str = "fsdp",
    min_shard_size: int = 2**12,
    require_rule_matches: bool = True,
):
    """A PartitionSpec for every leaf of `tree` (see the module docstring)."""
    compiled = [(re.compile(pattern), as_spec(spec), pattern) for pattern, spec in rules]
    logical = dict(logical_axis_rules or {})
    hint_by_name = {}
    if hints is not None:
        for path, hint in jax.tree_util.tree_flatten_with_path(hints, is_leaf=lambda h: isinstance(h, P))[0]:
            hint_by_name[path_name(path)] = hint
    matched = set()

    def resolve(path, leaf):
        name, shape = path_name(path), tuple(np.shape(leaf))
        for regex, spec, pattern in compiled:
            if regex.search(name):
                matched.add(pattern)
                return check_spec(spec, shape, mesh, name, f"rule {pattern!r} ->")
        hint = hint_by_name.get(name)
        if isinstance(hint, P) and 0 < layer_stacks.layer_axes(hint) <= len(shape):
            return stage_spec(hint, shape, mesh, name, logical, fsdp_axis, min_shard_size)
        if isinstance(hint, P) and len(hint):
            mapped = as_spec(map_logical(hint, logical, mesh))
            return check_spec(mapped, shape, mesh, name, f"its sharding metadata {hint} ->")
        return default_spec(shape, mesh, fsdp_axis, min_shard_size)

    specs = jax.tree_util.tree_map_with_path(resolve, tree)
    unused = [pattern for _, _, pattern in compiled if pattern not in matched]
    if unused and require_rule_matches:
        names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        raise ValueError(f"Sharding rule {unused[0]!r} matches no parameter. Parameter paths are: {names}.")
    return specs


def follow_params(tree, params, param_specs):
    """Specs for a tree holding copies of the parameters (optimizer moments).

    A leaf whose path ends with a parameter's path and whose shape matches it
    takes that parameter's spec; everything else (step counts, scalars) is
    replicated.
    """
    by_path = {}
    for (path, leaf), spec in zip(
        jax.tree_util.tree_flatten_with_path(params)[0],
        jax.tree.leaves(param_specs, is_leaf=lambda s: isinstance(s, P)),
        strict=True,
    ):
        by_path[path_name(path)] = (tuple(np.shape(leaf)), spec)

    def follow(path, leaf):
        name, shape = path_name(path), tuple(np.shape(leaf))
        parts = name.split("/")
        for start in range(len(parts)):
            found = by_path.get("/".join(parts[start:]))
            if found is not None and found[0] == shape:
                return found[1]
        return P()

    return jax.tree_util.tree_map_with_path(follow, tree)


def flatten_specs(specs) -> list[tuple[Any, P]]:
    """`(path, spec)` for every PartitionSpec of a tree of them."""
    return jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, P))[0]


def spec_tree_leaves(specs) -> Iterable[P]:
    return jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))


def jit_keeping_layout(fn, carry_argnum: int | None, *, donate_argnums=()):
    """`jax.jit(fn)` whose first output keeps the layout argument `carry_argnum` had on the first call.

    A state a step returns is pinned to the layout it came in with, so GSPMD's
    choices cannot drift between steps and force a recompile.
    """
    carry_layout = {}

    def traced(*args):
        out = fn(*args)
        if "shardings" in carry_layout:
            out = (jax.lax.with_sharding_constraint(out[0], carry_layout["shardings"]), *out[1:])
        return out

    jitted = jax.jit(traced, donate_argnums=donate_argnums)

    def call(*args):
        if carry_argnum is not None and "shardings" not in carry_layout:
            carry_layout["shardings"] = jax.tree.map(lambda a: a.sharding, args[carry_argnum])
        return jitted(*args)

    call.lower, call._cache_size = jitted.lower, jitted._cache_size
    return call
