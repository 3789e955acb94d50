"""`model.summary()`: one row per weight, with totals."""

from __future__ import annotations

import jax
import numpy as np


def _human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _rows(model, tree, names):
    rows = []
    for name, leaf in zip(names, jax.tree.leaves(tree)):
        count = int(np.prod(leaf.shape))
        rows.append((name, str(tuple(leaf.shape)), str(leaf.dtype), count, count * leaf.dtype.itemsize))
    return rows


def format_summary(model) -> str:
    """The text `model.summary()` prints (no device transfer: shapes and dtypes only)."""
    params, non_trainable = model._weight_trees()
    names = model.weight_names()
    n_params = len(jax.tree.leaves(params))
    trainable = _rows(model, params, names[:n_params])
    frozen = _rows(model, non_trainable, names[n_params:])
    header = ("Weight", "Shape", "Dtype", "Params", "Bytes")
    table = [header] + [(n, s, d, f"{c:,}", _human_bytes(b)) for n, s, d, c, b in trainable + frozen]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    line = "-" * (sum(widths) + 2 * (len(widths) - 1))

    def fmt(row):
        return "  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))

    module_name = type(model._adapter.module).__name__
    lines = [f'Model: "{module_name}"  strategy: {model.strategy!r}', line, fmt(header), line]
    lines += [fmt(row) for row in table[1:]]
    t_count, t_bytes = sum(r[3] for r in trainable), sum(r[4] for r in trainable)
    f_count, f_bytes = sum(r[3] for r in frozen), sum(r[4] for r in frozen)
    lines += [
        line,
        f"Total params: {t_count + f_count:,} ({_human_bytes(t_bytes + f_bytes)})",
        f"Trainable params: {t_count:,} ({_human_bytes(t_bytes)})",
        f"Non-trainable params: {f_count:,} ({_human_bytes(f_bytes)})",
    ]
    return "\n".join(lines)
