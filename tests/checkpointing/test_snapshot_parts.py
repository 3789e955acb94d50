"""Snapshot parts from a keeper are parsed totally: every malformed part, header or JSON part is refused.

A part comes back from another process (the launcher's keeper), so it is read
as untrusted bytes: a real part of a real fit (BackupAndRestore with
`memory_freq`, a real in-process `Keeper`) is damaged in each way below, and
each damaged part must be refused by `MemoryTier.restore` with its warning,
the refusal a `ValueError` of the checks (`snapshot_parts.unpack_header`,
`BackupSchema.check_meta`), never another exception and never an allocation
the part asks for.
"""

import copy
import io
import json
import os
import struct
import warnings

import jax
import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf
from meshfit.checkpointing import checkpoint_schema, memory_tier, snapshot_parts
from meshfit.checkpointing.checkpoint_schema import BACKUP, MAX_JSON_DEPTH
from meshfit.launch.keeper import Keeper

TIB = 1 << 40


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """(step, part, template_of, model) of a real snapshot: 2 epochs of 6 steps, a snapshot every 2 steps, the
    newest (step 12) holding EarlyStopping's best weights as arrays; and a `MemoryTier` to restore it with."""
    with pytest.MonkeyPatch.context() as patch:
        keeper = Keeper(io.StringIO())
        for name, value in keeper.env().items():
            patch.setenv(name, value)
        try:
            x, y = classification_data(n=96)
            model = mf.Model(MLP(), seed=3)
            model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
            backup_dir = str(tmp_path_factory.mktemp("snapshot") / "b")
            callbacks = [
                mf.callbacks.BackupAndRestore(backup_dir, save_freq=1000, memory_freq=2, delete_checkpoint=False),
                mf.callbacks.EarlyStopping(monitor="loss", patience=5, restore_best_weights=True),
            ]
            model.fit(x, y, batch_size=16, epochs=2, callbacks=callbacks, verbose=0)
            tier = memory_tier.MemoryTier(os.path.abspath(backup_dir))
            step, part = tier.newest()

            def template_of(meta):
                return BACKUP.target(model.session.latest, meta)

            yield step, bytes(part), template_of, model, tier
            tier.close()
        finally:
            keeper.close()


def split(part: bytes) -> tuple[dict, bytes]:
    header, data = snapshot_parts.unpack_header(part)
    return copy.deepcopy(header), bytes(data)


def joined(header, data: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return snapshot_parts.MAGIC + struct.pack(">Q", len(raw)) + raw + data


def header_edit(edit):
    """A corpus entry: the part with its header changed by `edit(header, data)` (which may return the raw header
    bytes to write instead)."""

    def make(step, part):
        header, data = split(part)
        raw = edit(header, data)
        return step, joined(header if raw is None else raw, data)

    return make


def meta_edit(edit):
    """A corpus entry: the part with its JSON part changed by `edit(meta)`."""
    return header_edit(lambda header, data: edit(header["meta"]))


def kernel(header: dict) -> dict:
    """The header's leaf of the first layer's kernel, a device array of shape (4, 16)."""
    found = next(leaf for leaf in header["leaves"] if leaf["path"] == "train/params/hidden/kernel")
    assert found["shape"] == [4, 16], found
    return found


def leaf_edit(edit):
    """A corpus entry: the part with the kernel's leaf changed by `edit(leaf)`."""

    def change(header, data):
        edit(kernel(header))

    return header_edit(change)


def shard_edit(edit):
    return leaf_edit(lambda leaf: edit(leaf["shards"][0]))


def bytes_edit(edit):
    return lambda step, part: (step, edit(part))


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def setitem(key, value):
    return lambda target: target.__setitem__(key, value)


def delitem(key):
    return lambda target: target.__delitem__(key)


def a_leaf_twice(header, data):
    header["leaves"].append(header["leaves"][0])


def shards_twice(leaf):
    leaf["shards"].append(leaf["shards"][0])


def past_the_end(header, data):
    shard = kernel(header)["shards"][0]
    shard["offset"] = len(data) - shard["nbytes"] + 1


def step_of_the_part(step, part):
    return step + 2, part  # the keeper says step + 2; the part holds step


def dangling_reference(meta):
    meta["callbacks"]["EarlyStopping"]["best_weights"][0] = {"__array__": "a999"}


def reference_not_a_name(meta):
    meta["callbacks"]["EarlyStopping"]["best_weights"][0] = {"__array__": ["a0"]}


def array_specs_of(spec):
    return meta_edit(lambda meta: meta["array_specs"].__setitem__("a0", spec))


CORPUS = {
    # the bytes around the header
    "empty": bytes_edit(lambda part: b""),
    "magic only": bytes_edit(lambda part: snapshot_parts.MAGIC),
    "another magic": bytes_edit(lambda part: b"MFSNAP2\n" + part[8:]),
    "cut in the header length": bytes_edit(lambda part: part[:12]),
    "header length 2**63": bytes_edit(lambda part: part[:8] + struct.pack(">Q", 1 << 63) + part[16:]),
    "header length one past the end": bytes_edit(lambda part: part[:8] + struct.pack(">Q", len(part) - 15) + part[16:]),
    "cut in the header": bytes_edit(lambda part: part[:100]),
    "cut in the arrays": bytes_edit(lambda part: part[:-1]),
    "header not UTF-8": header_edit(lambda header, data: b'{"step": "\xff"}'),
    "header not JSON": header_edit(lambda header, data: b'{"step": 12, nope'),
    "header an unterminated string of escapes": header_edit(lambda header, data: b'"' + b'\\"' * 50_000),
    # nesting
    "header lists nested 10**5 deep": header_edit(lambda header, data: nested(10**5)),
    "header objects nested 10**5 deep": header_edit(lambda header, data: b'{"a":' * 10**5 + b"1" + b"}" * 10**5),
    "meta nested 10**5 deep": header_edit(
        lambda header, data: b'{"step": 12, "leaves": [], "meta": ' + nested(10**5) + b"}"
    ),
    "meta nested 10**5 deep, unclosed": header_edit(lambda header, data: b'{"meta": ' + b"[" * 10**5),
    f"meta nested {MAX_JSON_DEPTH + 1} deep": meta_edit(
        lambda meta: meta["data"].__setitem__("x", json.loads(nested(MAX_JSON_DEPTH + 1)))
    ),
    # the header's own fields
    "header a list": header_edit(lambda header, data: b"[]"),
    "header a string": header_edit(lambda header, data: b'"header"'),
    "header a number": header_edit(lambda header, data: b"12"),
    "header null": header_edit(lambda header, data: b"null"),
    "header lacks leaves": header_edit(lambda header, data: delitem("leaves")(header)),
    "header lacks meta": header_edit(lambda header, data: delitem("meta")(header)),
    "step -1": header_edit(lambda header, data: header.__setitem__("step", -1)),
    "step true": header_edit(lambda header, data: header.__setitem__("step", True)),
    "step 12.0": header_edit(lambda header, data: header.__setitem__("step", 12.0)),
    "step a string": header_edit(lambda header, data: header.__setitem__("step", "12")),
    "step not the one fetched": step_of_the_part,
    "meta a list": header_edit(lambda header, data: header.__setitem__("meta", [])),
    "meta null": header_edit(lambda header, data: header.__setitem__("meta", None)),
    "leaves an object": header_edit(lambda header, data: header.__setitem__("leaves", {})),
    "a leaf a string": header_edit(lambda header, data: header["leaves"].__setitem__(0, "kernel")),
    "a leaf twice": header_edit(a_leaf_twice),
    "a leaf lacks shards": leaf_edit(delitem("shards")),
    "a leaf's path a number": leaf_edit(setitem("path", 3)),
    # dtypes and shapes
    "dtype object": leaf_edit(setitem("dtype", "object")),
    "dtype a string array's": leaf_edit(setitem("dtype", "str160")),
    "dtype float128": leaf_edit(setitem("dtype", "float128")),
    "dtype a number": leaf_edit(setitem("dtype", 11)),
    "dtype <f4": leaf_edit(setitem("dtype", "<f4")),
    "shape of 8 TiB": leaf_edit(setitem("shape", [TIB, 8])),
    "shape and shard of 8 TiB": leaf_edit(
        lambda leaf: leaf.update(shape=[TIB, 2], shards=[{"index": f"0:{TIB},0:2", "offset": 0, "nbytes": 8 * TIB}])
    ),
    "shape beyond numpy": leaf_edit(setitem("shape", [1 << 62, 1 << 62])),
    "shape beyond numpy with an axis of 0": leaf_edit(setitem("shape", [0, 1 << 62, 1 << 62])),
    "shape negative": leaf_edit(setitem("shape", [-4, 16])),
    "shape of booleans": leaf_edit(setitem("shape", [True, True])),
    "shape of floats": leaf_edit(setitem("shape", [4.0, 16.0])),
    "shape of rank 40": leaf_edit(setitem("shape", [1] * 40)),
    "shape a number": leaf_edit(setitem("shape", 64)),
    # shards
    "shards an object": leaf_edit(setitem("shards", {})),
    "a shard a list": leaf_edit(lambda leaf: leaf["shards"].__setitem__(0, [0, 4, 64])),
    "a shard lacks nbytes": shard_edit(delitem("nbytes")),
    "a shard's offset past the end": shard_edit(setitem("offset", 1 << 62)),
    "a shard's bytes one past the end": header_edit(past_the_end),
    "a shard's offset -8": shard_edit(setitem("offset", -8)),
    "a shard's offset a float": shard_edit(setitem("offset", 8.0)),
    "a shard's offset true": shard_edit(setitem("offset", True)),
    "a shard's nbytes one short": shard_edit(lambda shard: shard.__setitem__("nbytes", shard["nbytes"] - 1)),
    "a shard's nbytes 8 TiB": shard_edit(setitem("nbytes", 8 * TIB)),
    "a shard's nbytes -4": shard_edit(setitem("nbytes", -4)),
    "a shard twice": leaf_edit(shards_twice),
    "an index a list": shard_edit(setitem("index", [[0, 4], [0, 16]])),
    "an index with a step": shard_edit(setitem("index", "0:4:1,0:16")),
    "an index past the shape": shard_edit(setitem("index", "0:99,0:16")),
    "an index backwards": shard_edit(setitem("index", "4:0,0:16")),
    "an index negative": shard_edit(setitem("index", "-4:4,0:16")),
    "an index with spaces": shard_edit(setitem("index", " 0:4,0:16")),
    "an index with leading zeros": shard_edit(setitem("index", "00:4,0:16")),
    "an index in Arabic digits": shard_edit(setitem("index", "\u0660:4,0:16")),
    "an index of one axis": shard_edit(setitem("index", "0:4")),
    "an index of 10**5 digits": shard_edit(setitem("index", "0:" + "9" * 10**5 + ",0:16")),
    "an index empty": shard_edit(setitem("index", "")),
    # the JSON part
    "meta lacks epoch": meta_edit(delitem("epoch")),
    "meta lacks history": meta_edit(delitem("history")),
    "meta lacks callbacks": meta_edit(delitem("callbacks")),
    "meta lacks array_specs": meta_edit(delitem("array_specs")),
    "epoch -1": meta_edit(setitem("epoch", -1)),
    "epoch true": meta_edit(setitem("epoch", True)),
    "epoch 1.0": meta_edit(setitem("epoch", 1.0)),
    "epoch a string": meta_edit(setitem("epoch", "1")),
    "epoch null": meta_edit(setitem("epoch", None)),
    "epoch 10**9": meta_edit(setitem("epoch", 10**9)),
    "epoch of 4,000 digits": meta_edit(setitem("epoch", 10**3999)),
    "step_in_epoch of 4,000 digits": meta_edit(setitem("step_in_epoch", 10**3999)),
    "step_in_epoch -1": meta_edit(setitem("step_in_epoch", -1)),
    "step_in_epoch beyond the step": meta_edit(setitem("step_in_epoch", 13)),
    "data_origin before pass 0": meta_edit(setitem("data_origin", -2)),
    "data_origin 0.5": meta_edit(setitem("data_origin", 0.5)),
    "format 99": meta_edit(setitem("format", 99)),
    "format a string": meta_edit(setitem("format", "2")),
    "history a list": meta_edit(setitem("history", [])),
    "history of numbers": meta_edit(setitem("history", {"loss": 0.5})),
    "history_epochs null": meta_edit(setitem("history_epochs", None)),
    "history_epochs of strings": meta_edit(setitem("history_epochs", ["0"])),
    "history_epochs negative": meta_edit(setitem("history_epochs", [-1])),
    "callbacks a list": meta_edit(setitem("callbacks", [])),
    "a callback's state a number": meta_edit(lambda meta: meta["callbacks"].__setitem__("EarlyStopping", 3)),
    "a callback's state null": meta_edit(lambda meta: meta["callbacks"].__setitem__("EarlyStopping", None)),
    "data a list": meta_edit(setitem("data", [])),
    "array_specs a list": meta_edit(setitem("array_specs", [])),
    "array_specs of 8 TiB": array_specs_of([[TIB], "float64"]),
    "array_specs of 8 TiB in many arrays": meta_edit(
        lambda meta: meta["array_specs"].update({f"x{i}": [[1 << 30], "float64"] for i in range(1024)})
    ),
    "array_specs beyond the part's bytes": array_specs_of([[1 << 20], "float32"]),
    "array_specs beyond numpy": array_specs_of([[1 << 62, 1 << 62], "float32"]),
    "array_specs entry of three": array_specs_of([[4], "float32", 1]),
    "array_specs entry an object": array_specs_of({"shape": [4], "dtype": "float32"}),
    "array_specs dtype object": array_specs_of([[4], "object"]),
    "array_specs shape negative": array_specs_of([[-4], "float32"]),
    "array_specs shape of rank 40": array_specs_of([[1] * 40, "float32"]),
    "array_specs shape not the array's": array_specs_of([[3], "float32"]),
    "a reference to no array": meta_edit(dangling_reference),
    "a reference that is not a name": meta_edit(reference_not_a_name),
    "a reference to no array in data": meta_edit(lambda meta: meta["data"].__setitem__("x", {"__array__": "zz"})),
}


def checked(step: int, part: bytes, template_of):
    """What `MemoryTier.restore` does, with its checks' exceptions left to propagate."""
    header, data = snapshot_parts.unpack_header(part)
    if header["step"] != step:
        raise ValueError(f"the part holds step {header['step']}")
    BACKUP.check_meta(header["meta"], step, array_bytes=len(data), first_epoch=0)
    return snapshot_parts.unpack(part, template_of(header["meta"])), header["meta"]


def test_the_corpus_is_large():
    assert len(CORPUS) >= 30


def test_a_real_part_passes_every_check_and_round_trips(real):
    step, part, template_of, model, tier = real
    header, data = snapshot_parts.unpack_header(part)
    meta = header["meta"]
    assert step == header["step"] == 12 and meta["epoch"] == 1 and meta["step_in_epoch"] == 6
    assert meta["callbacks"]["EarlyStopping"]["best_weights"], "the corpus damages the arrays' references"
    BACKUP.check_meta(meta, step, array_bytes=len(data), first_epoch=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tree, restored_meta = tier.restore(step, part, template_of, first_epoch=0)
    assert not [w for w in caught if "not restored" in str(w.message)]
    backup = BACKUP.restored(step, tree, restored_meta)
    assert (backup.epoch, backup.step_in_epoch, backup.step) == (1, 6, 12)
    for a, b in zip(jax.tree.leaves(backup.state.params), jax.tree.leaves(model.session.latest.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    saved_weights = backup.callbacks["EarlyStopping"]["best_weights"]
    assert saved_weights and all(isinstance(w, np.ndarray) for w in saved_weights)


@pytest.mark.parametrize("name", list(CORPUS))
def test_a_malformed_part_is_refused_with_the_warning_and_nothing_else(name, real):
    step, part, template_of, _, tier = real
    bad_step, bad = CORPUS[name](step, part)
    assert bad != part or bad_step != step
    with pytest.raises(ValueError):  # a check refuses it: not the last guard's catch of another exception
        checked(bad_step, bad, template_of)
    with pytest.warns(UserWarning, match=rf"the memory snapshot of step {bad_step} does not fit this fit \(.+\); not"):
        assert tier.restore(bad_step, bad, template_of, first_epoch=0) is None


def test_a_refusal_names_the_field():
    part = bytes(snapshot_parts.pack(4, {"w": np.arange(8.0).reshape(4, 2)}, {}))
    header, data = split(part)
    header["leaves"][0]["shards"][0]["nbytes"] = 63
    with pytest.raises(ValueError, match=r"w \(leaves\[0\]\) \[0:4,0:2\]: nbytes=63, expected 8 elements of float64"):
        snapshot_parts.unpack_header(joined(header, data))
    with pytest.raises(ValueError, match="header length: 1,000 bytes, past the end of the part"):
        snapshot_parts.unpack_header(snapshot_parts.MAGIC + struct.pack(">Q", 1000) + b"{}")
    with pytest.raises(ValueError, match=f"header: lists and objects nested deeper than {MAX_JSON_DEPTH} levels"):
        snapshot_parts.unpack_header(joined(nested(10**5), b""))


def test_brackets_quotes_and_escapes_inside_strings_do_not_count_as_nesting():
    tricky = '[[[{{{ \\" ]]] \\\\" [[[' * 10_000  # ends each repeat with an escaped backslash, then a quote
    meta = {"s": tricky, "t": ["\\", '"', "[" * 1000]}
    part = bytes(snapshot_parts.pack(1, {"w": np.zeros(3)}, meta))
    header, _ = snapshot_parts.unpack_header(part)
    assert header["meta"] == meta
    np.testing.assert_array_equal(snapshot_parts.unpack(part, {"w": np.ones(3)})["w"], np.zeros(3))


def meta_of(**changes):
    meta = {
        "epoch": 0,
        "step_in_epoch": 0,
        "data_origin": 0,
        "history": {},
        "history_epochs": [],
        "callbacks": {"EarlyStopping": {"wait": 0, "best_weights": [{"__array__": "a0"}]}},
        "data": {},
        "format": checkpoint_schema.BACKUP_FORMAT,
        "array_specs": {"a0": [[4, 2], "bfloat16"]},
    }
    return {**meta, **changes}


def test_check_meta_takes_every_backup_a_fit_writes():
    """An `initial_epoch` above the steps taken (a fit begun at epoch 5 after `compile`, or after
    `load_weights`) backs up its epoch at any step, with a data origin below 0; a format-1 backup lacks
    `data_origin` and `format`; a `"job"` entry is another writer's."""
    BACKUP.check_meta(meta_of(epoch=5, data_origin=-5, step_in_epoch=2), step=2)
    BACKUP.check_meta(meta_of(epoch=5, data_origin=-5, step_in_epoch=2), step=2, first_epoch=5)
    old = meta_of(format=1)
    del old["data_origin"], old["format"]
    BACKUP.check_meta(old, step=0)
    BACKUP.check_meta(meta_of(job={"id": "abc", "restarts": 3}), step=0, array_bytes=16)
    BACKUP.check_meta(meta_of(history={"loss": [0.5, float("nan")]}, history_epochs=[0, 1], epoch=2), step=12)


def test_check_meta_refuses_what_restored_cannot_take():
    with pytest.raises(ValueError, match="epoch: epoch 1000000000 at step 12 of a fit begun at epoch 0"):
        BACKUP.check_meta(meta_of(epoch=10**9), 12, first_epoch=0)
    with pytest.raises(ValueError, match=r"array_specs: 16 bytes of arrays, more than the 15 bytes"):
        BACKUP.check_meta(meta_of(), 0, array_bytes=15)
    with pytest.raises(ValueError, match=r"array_specs\['a0'\]: expected a dtype, one of .*bfloat16.*Received: "):
        BACKUP.check_meta(meta_of(array_specs={"a0": [[4], "<U5"]}), 0)
    with pytest.raises(ValueError, match="callbacks: a reference to array 'a1', expected a name in array_specs"):
        BACKUP.check_meta(meta_of(callbacks={"E": {"w": {"__array__": "a1"}}}), 0)
    with pytest.raises(ValueError, match="lacks history, array_specs; it was not written by BackupAndRestore"):
        BACKUP.check_meta({k: v for k, v in meta_of().items() if k not in ("history", "array_specs")}, 0)
    with pytest.raises(ValueError, match="step: expected an int >= 0"):
        BACKUP.check_meta(meta_of(), -1)
    deep: list = []
    for _ in range(10**5):  # deeper than Python's recursion limit: refused without recursing
        deep = [deep]
    with pytest.raises(ValueError, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
        BACKUP.check_meta(meta_of(data={"x": deep}), 0)
