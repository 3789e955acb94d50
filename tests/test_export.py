"""`model.export`: a forward pass that JAX alone loads and calls on batches of any size."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf

LOADER = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np
    path, inputs, out = sys.argv[1:4]
    exported = jax.export.deserialize(open(f"{path}/forward.jax", "rb").read())
    stored = np.load(f"{path}/weights.npz")
    weights = [stored[f"w{i}"] for i in range(len(stored.files))]
    x = np.load(inputs)["x"]
    results = {str(n): np.asarray(exported.call(weights, x[:n])) for n in (1, 7, 32)}
    assert "flax" not in sys.modules and "meshfit" not in sys.modules, sorted(sys.modules)
    np.savez(out, **results)
    """
)


def trained_model():
    x, y = classification_data(n=64)
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model, x


@pytest.mark.slow
@pytest.mark.processes
def test_an_export_loads_and_runs_with_jax_alone_on_any_batch_size(tmp_path):
    model, x = trained_model()
    model.export(tmp_path / "served")
    assert sorted(os.listdir(tmp_path / "served")) == ["forward.jax", "weights.npz"]
    np.savez(tmp_path / "x.npz", x=x)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # meshfit not importable there
    subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path / "served"), str(tmp_path / "x.npz"), str(tmp_path / "y.npz")],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    served = np.load(tmp_path / "y.npz")
    for n in (1, 7, 32):
        np.testing.assert_allclose(served[str(n)], model.predict(x[:n], verbose=0), rtol=1e-5, atol=1e-6)


def test_export_refuses_a_non_empty_path_unless_overwrite_and_then_only_an_export(tmp_path):
    model, x = trained_model()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        model.export(tmp_path / "mine")
    with pytest.raises(FileExistsError, match="replaces only an earlier export"):
        model.export(tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    model.export(tmp_path / "served")
    first = (tmp_path / "served" / "weights.npz").read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        model.export(tmp_path / "served")
    model.fit(x, np.zeros(len(x), np.int32), batch_size=16, epochs=1, verbose=0)
    model.export(tmp_path / "served", overwrite=True)
    assert (tmp_path / "served" / "weights.npz").read_bytes() != first
    assert sorted(os.listdir(tmp_path)) == ["mine", "served"]  # no staging directory left behind


def test_export_needs_input_shapes():
    model = mf.Model(MLP())
    with pytest.raises(ValueError, match="input shapes"):
        model.export("/nonexistent/never-written")
