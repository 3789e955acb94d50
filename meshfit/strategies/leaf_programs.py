"""Steps compiled on the state's leaves: the per-step program that never rebuilds the `TrainState` pytree.

Each call of a jitted function flattens its pytree arguments and rebuilds its
pytree outputs, in C++ but per node: for a small MLP's `TrainState` (a named
tuple of nested dicts, optax states, empty module-state dicts) that is about
2.7 µs in and 2.0 µs out on the CPU (`benchmarks/profile_step.py`), as long
as a tiny step's whole device time. A `LeafProgram` is compiled on the flat
list of the state's leaves instead, and `StateStore.advance` keeps the list
from one call to the next, so a run of steps flattens the state once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from meshfit.core import compat


class LeafProgram:
    """`step(state, *args) -> (state, logs)` compiled as `(leaves, *args) -> (leaves, logs)`, once per state
    structure (`on`).

    Args:
        compile: the strategy's `compile` (called with `donate_argnums=(0,)`: the leaves are donated).
        step: the step function on a whole state.
    """

    __slots__ = ("_compile", "_step", "_by_structure")

    def __init__(self, compile: Callable, step: Callable):
        self._compile = compile
        self._step = step
        self._by_structure: dict[Any, Callable] = {}

    def on(self, structure) -> Callable:
        """The program for states of `structure` (a `PyTreeDef`): `(leaves, *args) -> (leaves, logs)`."""
        program = self._by_structure.get(structure)
        if program is None:
            program = self._by_structure[structure] = self._compile(
                _on_leaves(self._step, structure), donate_argnums=(0,)
            )
        return program

    def __call__(self, state, *args):
        """The step on a whole state, for callers that hold one (the state store keeps leaves instead)."""
        leaves, structure = jax.tree.flatten(state)
        leaves, logs = self.on(structure)(leaves, *args)
        return structure.unflatten(leaves), logs

    def _cache_size(self) -> int:
        """Compilations, as `jax.jit`'s own count (`meshfit.core.compat.compilations`)."""
        return sum(compat.compilations(program) for program in self._by_structure.values())


def _on_leaves(step: Callable, structure) -> Callable:
    def on_leaves(leaves: list, *args):
        state, logs = step(structure.unflatten(leaves), *args)
        new_leaves, new_structure = jax.tree.flatten(state)
        if new_structure != structure:  # at trace time: a state must come back as it went in
            raise ValueError(
                "A train step must return a state structured as the one it received. Expected: "
                f"{structure}. Received: {new_structure}."
            )
        return new_leaves, logs

    # Named as the step (`jit(train_step)` in compilation logs and JAX's monitoring), not as this wrapper.
    on_leaves.__name__ = on_leaves.__qualname__ = getattr(step, "__name__", "step")
    return on_leaves
