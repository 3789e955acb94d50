"""Keras 3's own signatures against meshfit's: every Keras argument is accepted, or refused naming meshfit's way.

The installed `keras` is read with `inspect`: its callbacks that meshfit has, and `keras.Model.compile`, `fit`,
`evaluate`, `predict` and `save`. What differs is `meshfit.core.keras_names.KERAS_NAMES`, which docs/keras.md holds.
"""

import inspect
import os
import re

import pytest
from helpers import MLP

import meshfit as mf
from meshfit.core.keras_names import KERAS_NAMES, markdown_table, row

keras = pytest.importorskip("keras")

#: Keras arguments that another branch accepts (Model.compile's run_eagerly and jit_compile); empty once merged.
IMPLEMENTED_ELSEWHERE: set[tuple[str, str]] = set()

# The callbacks a user constructs (CallbackList is the loop's container, built by `fit`, not by users).
CALLBACKS = sorted(
    name
    for name in dir(keras.callbacks)
    if isinstance(getattr(keras.callbacks, name), type) and name in mf.callbacks.__all__ and name != "CallbackList"
)
METHODS = ["compile", "fit", "evaluate", "predict", "save"]
WHERE = CALLBACKS + [f"Model.{m}" for m in METHODS]
DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "keras.md")


def callables(where):
    """Keras's and meshfit's callable for `where` (a callback class's `__init__`, or a `Model` method)."""
    if where.startswith("Model."):
        method = where.split(".")[1]
        return getattr(keras.Model, method), getattr(mf.Model, method)
    return getattr(keras.callbacks, where).__init__, getattr(mf.callbacks, where).__init__


def named(fn):
    """Parameters by name, without `self`, `*args` and `**kwargs` (Keras's are legacy or internal names)."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {n: p for n, p in inspect.signature(fn).parameters.items() if n != "self" and p.kind not in variadic}


def positional(fn):
    return [n for n, p in named(fn).items() if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]


def alias_target(where, name):
    """meshfit's own name for a Keras alias: the row's text starts with it in backticks."""
    return re.match(r"`(\w+)`", row(where, name).meshfit).group(1)


def test_the_walk_covers_every_callback_meshfit_shares_with_keras():
    assert len(CALLBACKS) >= 11 and {"ModelCheckpoint", "TensorBoard", "BackupAndRestore"} <= set(CALLBACKS)


@pytest.mark.parametrize("where", WHERE)
def test_every_keras_argument_is_taken(where):
    """Each Keras argument is in meshfit's signature under Keras's name (accepted, or refused by value)."""
    keras_fn, meshfit_fn = callables(where)
    ours = named(meshfit_fn)
    missing = [n for n in named(keras_fn) if n not in ours and (where, n) not in IMPLEMENTED_ELSEWHERE]
    assert not missing, f"{where}: Keras's {missing} are neither accepted nor refused by meshfit."


@pytest.mark.parametrize("where", WHERE)
def test_kerass_positional_order(where):
    """Keras's positional arguments come first, in Keras's order (an alias in its meshfit name's place), up to
    the first one another branch implements."""
    keras_fn, meshfit_fn = callables(where)
    expected = []
    for name in positional(keras_fn):
        if (where, name) in IMPLEMENTED_ELSEWHERE:
            break
        known = {(e.where, e.name): e for e in KERAS_NAMES}
        entry = known.get((where, name))
        expected.append(alias_target(where, name) if entry and entry.kind == "alias" else name)
    assert positional(meshfit_fn)[: len(expected)] == expected


def test_every_row_names_a_keras_argument_meshfit_takes():
    """The table stays true: each row is an argument of the installed Keras and of meshfit."""
    for entry in KERAS_NAMES:
        keras_fn, meshfit_fn = callables(entry.where)
        assert entry.name in named(keras_fn), f"{entry.where}({entry.name}=...) is not Keras's"
        assert entry.name in named(meshfit_fn) or (entry.where, entry.name) in IMPLEMENTED_ELSEWHERE
        assert entry.kind in ("alias", "jax", "ignored", "refused")
        assert (entry.kind == "refused") == (entry.refused is not None)


def make(where, tmp_path, **kwargs):
    """Calls meshfit's `where` with `kwargs` (and a path for a callback's required argument)."""
    if where.startswith("Model."):
        model = mf.Model(MLP())
        method = where.split(".")[1]
        if method == "save":
            kwargs.setdefault("path", None if "filepath" in kwargs else tmp_path / "saved")
        return getattr(model, method)(**kwargs)
    cls = getattr(mf.callbacks, where)
    required = [
        n
        for n, p in named(cls.__init__).items()
        if p.default is inspect.Parameter.empty and p.kind != inspect.Parameter.KEYWORD_ONLY
    ]
    return cls(**{n: str(tmp_path / n) for n in required if n not in kwargs}, **kwargs)


@pytest.mark.parametrize("entry", [e for e in KERAS_NAMES if e.kind == "refused"], ids=lambda e: f"{e.where}.{e.name}")
def test_refused_values_name_meshfits_equivalent(entry, tmp_path):
    with pytest.raises((TypeError, ValueError)) as raised:
        make(entry.where, tmp_path, **entry.refused)
    message = str(raised.value)
    assert f"Keras's {entry.name}=" in message and entry.meshfit in message
    assert not os.listdir(tmp_path)  # refused before anything is written


@pytest.mark.parametrize("entry", [e for e in KERAS_NAMES if e.kind == "ignored"], ids=lambda e: f"{e.where}.{e.name}")
def test_ignored_arguments_warn_why(entry, tmp_path):
    with pytest.warns(UserWarning) as caught:
        make(entry.where, tmp_path, **{entry.name: 1})
    assert len(caught) == 1 and entry.meshfit in str(caught[0].message)


@pytest.mark.parametrize("entry", [e for e in KERAS_NAMES if e.kind == "alias"], ids=lambda e: f"{e.where}.{e.name}")
def test_aliases_take_kerass_name_and_refuse_both(entry, tmp_path):
    target = alias_target(entry.where, entry.name)
    make(entry.where, tmp_path, **{entry.name: str(tmp_path / "by_keras_name.keras")})
    with pytest.raises(TypeError, match=f"`{entry.name}` .Keras's name. and `{target}` .meshfit's."):
        make(entry.where, tmp_path, **{entry.name: str(tmp_path / "a"), target: str(tmp_path / "b")})


def test_model_save_under_kerass_names(tmp_path):
    """`model.save(filepath="model.keras", zipped=False)`: a directory of that name that `load_model` reads."""
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="mse")
    model.save(filepath=tmp_path / "model.keras", zipped=False)
    assert (tmp_path / "model.keras").is_dir()
    loaded = mf.load_model(tmp_path / "model.keras", MLP(seed=1))
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        assert (a == b).all()


def test_compile_auto_scale_loss_false_is_accepted_where_nothing_scales():
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="mse", auto_scale_loss=False)  # float32: Keras scales nothing either
    assert model.compiled


def test_docs_hold_the_table():
    with open(DOCS) as f:
        assert markdown_table() in f.read(), "docs/keras.md: paste meshfit.core.keras_names.markdown_table()"
