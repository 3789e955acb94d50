import jax.numpy as jnp
import numpy as np
import pytest

from meshfit.callbacks import CallbackList, TerminateOnNaN


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_stops_on_invalid_loss(make_model, capsys, bad):
    model = make_model()
    cbs = CallbackList([TerminateOnNaN()], model=model)
    cbs.on_train_batch_end(0, {"loss": jnp.asarray(0.5)})
    assert model.stop_training is False
    cbs.on_train_batch_end(1, {"loss": jnp.asarray(bad, dtype=jnp.float32)})
    assert model.stop_training is True
    assert capsys.readouterr().out == "Batch 1: Invalid loss, terminating training\n"


def test_ignores_missing_loss_and_finite_values(make_model):
    model = make_model()
    cb = TerminateOnNaN()
    cb.set_model(model)
    cb.on_train_batch_end(0, None)
    cb.on_train_batch_end(1, {"accuracy": jnp.asarray(np.nan)})
    cb.on_train_batch_end(2, {"loss": 1e30})
    assert model.stop_training is False


def test_raise_error(make_model):
    model = make_model()
    cb = TerminateOnNaN(raise_error=True)
    cb.set_model(model)
    with pytest.raises(RuntimeError, match="NaN or Inf loss encountered at batch 4"):
        cb.on_train_batch_end(4, {"loss": jnp.asarray(np.nan)})
    assert model.stop_training is False
