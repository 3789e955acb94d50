"""meshfit.mixed_precision: Keras's global dtype policy, used by `compile` when it is given none."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import MLP, classification_data

import meshfit as mf

mp = mf.mixed_precision


@pytest.fixture(autouse=True)
def float32_after():
    """Every test leaves the global policy as it found it: the default, float32."""
    assert mp.global_policy().name == "float32"
    yield
    mp.set_global_policy(None)


def compiled(**kwargs):
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", **kwargs)
    return model


def test_the_default_is_float32_and_names_and_policies_set_it():
    assert mp.global_policy() == mp.get("float32")
    mp.set_global_policy("mixed_bfloat16")
    policy = mp.global_policy()
    assert isinstance(policy, mp.DTypePolicy) and mp.Policy is mp.DTypePolicy
    assert (policy.name, policy.variable_dtype, policy.compute_dtype) == ("mixed_bfloat16", np.float32, jnp.bfloat16)
    mp.set_global_policy(mp.get("mixed_float16"))
    assert mp.global_policy().name == "mixed_float16"
    mp.set_global_policy(None)
    assert mp.global_policy().name == "float32"


@pytest.mark.parametrize(
    "bad,says",
    [
        ("half", r"Unknown dtype policy 'half'. Expected one of \['float32', 'mixed_bfloat16'"),
        (16, r"Expected a policy name such as 'mixed_bfloat16'.*Received: policy=16 of type int"),
    ],
)
def test_a_bad_policy_is_refused_and_the_global_is_unchanged(bad, says):
    mp.set_global_policy("bfloat16")
    with pytest.raises(ValueError, match=says):
        mp.set_global_policy(bad)
    assert mp.global_policy().name == "bfloat16"


def test_compile_uses_the_global_policy_unless_given_one():
    mp.set_global_policy("mixed_bfloat16")
    mixed = compiled()
    assert mixed.compile_settings.dtype_policy.name == "mixed_bfloat16"
    assert mixed.get_compile_config()["dtype_policy"] == "mixed_bfloat16"  # saved as such
    assert all(w.dtype == np.float32 for w in mixed.get_weights())  # float32 master weights
    assert compiled(dtype_policy="float32").compile_settings.dtype_policy.name == "float32"  # given: it wins
    mp.set_global_policy("bfloat16")
    assert all(w.dtype == jnp.bfloat16 for w in compiled().get_weights())


@pytest.mark.slow
def test_a_model_compiled_under_the_global_policy_computes_in_it():
    x, _ = classification_data(n=32)
    full = compiled()
    mp.set_global_policy("mixed_bfloat16")
    mixed = compiled()
    mixed.set_weights(full.get_weights())  # the same weights: any difference is the compute dtype
    a, b = full.predict(x, verbose=0), mixed.predict(x, verbose=0)
    assert b.dtype == np.float32 and 1e-4 < np.abs(a - b).max() < 0.1  # computed in bfloat16


@pytest.mark.slow
def test_a_saved_model_reloads_under_its_own_policy_whatever_the_global(tmp_path):
    x, y = classification_data(n=32)
    mp.set_global_policy("mixed_bfloat16")
    model = compiled()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.save(tmp_path / "m")
    mp.set_global_policy("float32")
    loaded = mf.load_model(tmp_path / "m", MLP(seed=2))
    assert loaded.compile_settings.dtype_policy.name == "mixed_bfloat16"
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


class NeedsBFloat16(nnx.Module):
    """Refuses to run unless its input and weights are bfloat16, as cuDNN's attention refuses float32."""

    def __init__(self, din=4, dout=3, rngs=None):
        self.dense = nnx.Linear(din, dout, rngs=rngs or nnx.Rngs(0))

    def __call__(self, x):
        kinds = {x.dtype, self.dense.kernel[...].dtype, self.dense.bias[...].dtype}
        if kinds != {jnp.dtype(jnp.bfloat16)}:
            raise TypeError(f"NeedsBFloat16 computes in bfloat16 only. Received: {sorted(map(str, kinds))}.")
        return self.dense(x)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_every_call_of_the_module_runs_under_the_compiled_policy():
    x, y = classification_data(n=32)
    model = mf.Model(NeedsBFloat16())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", dtype_policy="mixed_bfloat16")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert set(model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)) == {"loss"}
    assert model.predict(x, batch_size=16, verbose=0).dtype == np.float32
    assert "step" in model.summary(print_fn=None).lower()
    assert model.step_report(x[:16], y[:16]).flops > 0
    plan = mf.plan(
        NeedsBFloat16,
        x[:8],
        y[:8],
        compile=dict(optimizer="adam", loss="sparse_categorical_crossentropy", dtype_policy="mixed_bfloat16"),
        devices=jax.devices()[:1],
    )
    assert plan.candidates and plan.candidates[0].report is not None


def test_predict_without_compile_uses_the_global_policy():
    mp.set_global_policy("mixed_bfloat16")
    x, _ = classification_data(n=16)
    assert mf.Model(NeedsBFloat16()).predict(x, batch_size=8, verbose=0).shape == (16, 3)
