"""config_check: a saved compile record is checked against what the built-ins accept, before anything."""

import json

import numpy as np
import pytest
from helpers import MLP, classification_data
from test_schedules import CASES as SCHEDULE_CASES
from test_serialization import CASE_IDS, CASES

import meshfit as mf
from meshfit.checkpointing import serialization
from meshfit.checkpointing.config_check import check_compile_record

NOT_A_VALUE = {"a": 1}  # a JSON object no built-in argument takes (not a record of a built-in)


def entry_of(cls):
    return "loss" if issubclass(cls, mf.losses.Loss) else "metrics"


def record_of(obj):
    return json.loads(json.dumps(serialization.serialize(obj)))


@pytest.mark.parametrize("cls,kwargs", CASES, ids=CASE_IDS)
def test_what_save_writes_for_every_built_in_passes_and_each_argument_of_another_type_is_refused(cls, kwargs):
    record = record_of(cls(**kwargs))
    entry = entry_of(cls)
    check_compile_record({entry: record, "weighted_metrics": [record] if entry == "metrics" else []})
    for key in record["config"]:
        garbled = {**record, "config": {**record["config"], key: NOT_A_VALUE}}
        with pytest.raises(ValueError, match=rf"setting `{entry}.config.{key}` is not one meshfit accepts: expected"):
            check_compile_record({entry: garbled})


@pytest.mark.parametrize("name", mf.optimizers.names())
def test_every_optimizer_recipe_passes_and_its_numbers_are_typed_from_the_optax_factory(name):
    record = json.loads(json.dumps(serialization.serialize_optimizer(mf.optimizers.get(name, clipnorm=1.0))))
    check_compile_record({"optimizer": record})
    numbers = [key for key, value in record["config"].items() if isinstance(value, float)]
    assert "learning_rate" in numbers and "clipnorm" in numbers
    for key in numbers:
        garbled = {**record, "config": {**record["config"], key: "fast"}}
        with pytest.raises(ValueError, match=rf"`optimizer.config.{key}` .* Received: optimizer.config.{key}=\"fast\""):
            check_compile_record({"optimizer": garbled})


@pytest.mark.parametrize("case", sorted(SCHEDULE_CASES))
def test_every_schedule_passes_as_a_learning_rate_and_its_arguments_are_typed(case):
    schedule, _ = SCHEDULE_CASES[case]
    record = json.loads(json.dumps(serialization.serialize_optimizer(mf.optimizers.get("sgd", learning_rate=schedule))))
    check_compile_record({"optimizer": record})
    config = record["config"]["learning_rate"]["config"]
    for key in config:
        lr = {**record["config"]["learning_rate"], "config": {**config, key: NOT_A_VALUE}}
        with pytest.raises(ValueError, match=rf"`optimizer.config.learning_rate.config.{key}` is not one"):
            check_compile_record({"optimizer": {**record, "config": {**record["config"], "learning_rate": lr}}})


HUBER_OF_MEAN = record_of(mf.losses.Huber(delta=mf.metrics.Mean()))
COSINE_OVER_0_STEPS = {
    "__class__": "meshfit.schedules.CosineDecay",
    "config": {"initial_learning_rate": 0.1, "decay_steps": 0},
}


@pytest.mark.parametrize(
    "record,says",
    [
        ({"loss": HUBER_OF_MEAN}, r"`loss.config.delta` .*expected a finite number. Received: loss.config.delta={"),
        ({"steps_per_execution": 10**12}, r"`steps_per_execution` .*below 2\*\*31.*Received: steps_per_execution=1000"),
        ({"steps_per_execution": True}, r"`steps_per_execution` .*Received: steps_per_execution=true"),
        ({"gradient_accumulation_steps": 0}, r"`gradient_accumulation_steps` .*a positive int"),
        ({"dtype_policy": "float8"}, r"`dtype_policy` .*one of \['float32'.*Received: dtype_policy=\"float8\""),
        ({"loss_weights": {"cls": 1.0, "reg": float("nan")}}, r"`loss_weights.reg` .*a finite number.*=NaN"),
        ({"loss_weights": ["accuracy"]}, r"`loss_weights\[0\]` .*a finite number"),
        ({"loss": "mystery"}, r"`loss` .*a loss name meshfit knows \(see meshfit.losses\).*Received: loss=\"mystery\""),
        ({"metrics": {"out": ["accuracy", "nope"]}}, r"`metrics.out\[1\]` .*a metric name meshfit knows"),
        ({"loss": {"__class__": "os.system", "config": {}}}, r"`loss` .*a record of a built-in class, one of \["),
        ({"loss": {"__class__": "meshfit.metrics.AUC"}}, r"`loss` .*one of \['meshfit.losses.BinaryCrossentropy'"),
        ({"loss": {"__function__": "builtins.eval"}}, r"`loss` .*a built-in function, one of"),
        ({"loss": {"__class__": "meshfit.losses.Huber", "config": {"delta": 1.0, "rm": 1}}}, r"`loss.config.rm`"),
        (
            {"metrics": [{"__class__": "meshfit.metrics.Precision", "config": {"thresholds": 1.5}}]},
            r"`metrics\[0\]` "
            r".*Precision refuses its saved arguments: Expected `thresholds` to be one float in \[0, 1\]",
        ),
        (
            {"metrics": [{"__class__": "meshfit.metrics.TopKCategoricalAccuracy", "config": {"k": 2.5}}]},
            r"`metrics\[0\].config.k` .*expected an int",
        ),
        ({"optimizer": "adamm"}, r"`optimizer` .*an optimizer name, one of \['adadelta'"),
        ({"optimizer": {"name": None, "config": {}}}, r"`optimizer.name` .*an optimizer name"),
        (
            {"optimizer": {"name": "sgd", "config": {"learning_rate": {"__function__": "meshfit.losses.huber"}}}},
            r"`optimizer.config.learning_rate` .*a finite number or a record of a meshfit.optimizers.schedules class",
        ),
        ({"optimizer": {"name": "adam", "config": {"b1": 0.9}, "extra": 1}}, r"`optimizer` .*\{\"name\": \.\.\."),
        (
            {"optimizer": {"name": "adam", "config": {"clipnorm": -1.0}}},
            r"`optimizer` .*adam refuses its saved arguments: `clipnorm` must be a positive number",
        ),
        (
            {"optimizer": {"name": "sgd", "config": {"learning_rate": {"__class__": "meshfit.losses.Huber"}}}},
            r"`optimizer.config.learning_rate` .*one of \['meshfit.schedules.CosineDecay'",
        ),
        (
            {"optimizer": {"name": "sgd", "config": {"learning_rate": COSINE_OVER_0_STEPS}}},
            r"`optimizer.config.learning_rate` .*CosineDecay refuses its saved arguments: Argument `decay_steps`",
        ),
        ({"compile_later": 1}, r"`compile.compile_later` .*one of the entries \['optimizer'.*load with compile=False"),
    ],
)
def test_garbled_records_are_refused_naming_the_field_what_was_expected_and_what_came(record, says):
    with pytest.raises(ValueError, match=says):
        check_compile_record(record)


def test_placeholders_of_what_could_not_be_saved_and_settings_given_again_are_left_to_load_model():
    check_compile_record({"loss": {"__custom__": "my_loss"}, "optimizer": {"__custom__": "an optax transformation"}})
    check_compile_record({"loss": HUBER_OF_MEAN, "steps_per_execution": 10**12}, skip={"loss", "steps_per_execution"})


@pytest.mark.slow
def test_load_model_refuses_a_garbled_record_before_the_module_is_made(tmp_path):
    x, labels = classification_data(n=32)
    y = np.eye(3, dtype=np.float32)[labels]
    model = mf.Model(MLP())
    huber = mf.losses.Huber(delta=0.5)
    model.compile(optimizer="adam", loss=huber, metrics=["accuracy"])
    model.save(tmp_path / "m")
    meta = tmp_path / "m" / "0" / "meta" / "metadata"
    saved = json.loads(meta.read_text())
    built = []
    factory = lambda: built.append(1) or MLP(seed=3)  # noqa: E731
    for entry, value, says, again in [
        ("loss", HUBER_OF_MEAN, r"`loss.config.delta` is not one meshfit accepts: expected a finite", huber),
        ("steps_per_execution", 10**12, r"`steps_per_execution` is not one meshfit accepts", 1),
    ]:
        meta.write_text(json.dumps({**saved, "compile": {**saved["compile"], entry: value}}))
        files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        with pytest.raises(ValueError, match=says):
            mf.load_model(tmp_path / "m", factory)
        assert built == [] and sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == files
        # Given again, the garbled entry is not read: the model loads and evaluates as saved.
        loaded = mf.load_model(tmp_path / "m", MLP(seed=3), **{entry: again})
        assert loaded.evaluate(x, y, verbose=0) == model.evaluate(x, y, verbose=0)
    assert np.array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
