"""The current strategy: the innermost `scope()`, or a default `OneDeviceStrategy`."""

from __future__ import annotations

from meshfit.strategies.base import Strategy, scope_stack
from meshfit.strategies.one_device import OneDeviceStrategy

_default: list[Strategy] = []


def get_strategy() -> Strategy:
    """The strategy of the innermost `scope()`, or the default `OneDeviceStrategy`."""
    stack = scope_stack()
    if stack:
        return stack[-1]
    if not _default:
        _default.append(OneDeviceStrategy())
    return _default[0]


def has_strategy() -> bool:
    """True inside some strategy's `scope()`."""
    return bool(scope_stack())
