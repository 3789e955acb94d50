"""`meshfit.plan`: every layout compiled abstractly, none over the memory limit picked, the pick trains."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import ResidualBlock, classification_data

import meshfit as mf
from meshfit.cost import roofline
from meshfit.cost.roofline import DeviceSpec
from meshfit.pipeline import Stages
from meshfit.planning import planner
from meshfit.planning.planner import Layout, layouts, stage_layouts

eight_devices = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (simulated on a CPU)")
COMPILE = dict(optimizer="adam", loss="sparse_categorical_crossentropy")


class Recorded(nnx.Module):
    """An MLP that notes whether its variables were real arrays when built, and each step it runs."""

    built: list = []  # True per construction that made arrays (not tracers)
    calls: list = []  # one entry per forward pass that ran (a step), none for one only traced

    def __init__(self, din=32, hidden=256, dout=10, remat=False):
        rngs = nnx.Rngs(0)
        self.hidden = nnx.Linear(din, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, dout, rngs=rngs)
        self.remat = remat
        Recorded.built.append(not isinstance(self.hidden.kernel[...], jax.core.Tracer))

    def __call__(self, x):
        jax.debug.callback(lambda: Recorded.calls.append(1))
        layer = nnx.remat(lambda m, h: nnx.relu(m(h))) if self.remat else (lambda m, h: nnx.relu(m(h)))
        return self.out(layer(self.hidden, x))


def state_bytes(din=32, hidden=256, dout=10) -> int:
    """Parameters and Adam's two moments, float32."""
    return 3 * 4 * (din * hidden + hidden + hidden * dout + dout)


def test_layouts_are_mirrored_and_every_factorisation_named_by_its_axes():
    assert [layout.name for layout in layouts(2)] == ["mirrored", "fsdp=2", "tensor=2"]
    eight = layouts(8)
    assert len(eight) == 1 + 10 - 1  # ordered triples of divisors whose product is 8, but 8x1x1: Mirrored
    names = {layout.name for layout in eight}
    assert {"fsdp=8", "data=2,fsdp=4", "data=2,fsdp=2,tensor=2", "tensor=8"} < names and len(names) == len(eight)
    assert all(np.prod([size for _, size in layout.axes]) == 8 for layout in eight[1:])
    assert Layout().strategy(jax.devices()[:2]).num_replicas_in_sync == 2


@pytest.mark.slow
@eight_devices
def test_plan_shards_what_does_not_fit_replicated_without_creating_or_running_anything():
    x, y = classification_data(n=64, din=32, classes=10)
    limit = state_bytes() * 3 // 4  # the state alone is over it on one device: it must be sharded
    Recorded.built.clear(), Recorded.calls.clear()
    before = {id(a) for a in jax.live_arrays()}
    result = mf.plan(lambda: Recorded(), x, y, compile=COMPILE, memory_limit=limit)
    assert Recorded.built and not any(Recorded.built)  # the factory ran under abstract evaluation only
    assert Recorded.calls == []  # no step ran
    new = [a.shape for a in jax.live_arrays() if id(a) not in before]
    assert (32, 256) not in new and (256, 10) not in new  # no parameter (nor Adam moment) exists
    assert result.compiled == len(result.candidates) == 10 and result.num_devices == 8

    mirrored = next(c for c in result.candidates if c.layout.axes is None)
    assert not mirrored.fits and mirrored.margin < 0 and mirrored.peak_bytes > limit
    best = result.best
    assert best.fits and best.margin == limit - best.peak_bytes >= 0
    assert dict(best.layout.axes)["fsdp"] > 1  # only layouts that shard the state fit
    fitting = [c for c in result.candidates if c.fits]
    assert [c.samples_per_second for c in fitting] == sorted((c.samples_per_second for c in fitting), reverse=True)
    assert all(not c.fits for c in result.candidates[len(fitting) :])
    text = str(result)
    assert "10 candidates compiled in" in text and "OVER" in text and best.layout.name in text.splitlines()[3]
    assert "step ≥ (roofline)" in text.splitlines()[1] and "a lower bound" in text.splitlines()[-2]

    strategy = best.strategy()
    assert isinstance(strategy, mf.strategies.MeshStrategy)
    with strategy.scope():
        model = mf.Model(lambda: Recorded())
        model.compile(**COMPILE)
    assert model.step_report(x, y).memory["peak"] == pytest.approx(best.peak_bytes, rel=0.05)
    history = model.fit(x, y, batch_size=64, epochs=2, verbose=0)
    assert Recorded.calls  # the check above can fail: a step that runs is seen
    assert np.isfinite(history.history["loss"]).all() and history.history["loss"][-1] < history.history["loss"][0]


@pytest.mark.slow
def test_plan_weighs_remat_and_batch_sizes_and_agrees_with_step_report():
    x, y = classification_data(n=16, din=32, classes=10)
    result = mf.plan(Recorded, x, y, compile=COMPILE, devices=jax.devices()[:1], batch_sizes=[16, 64])
    assert result.compiled == 2 * 2  # mirrored (one device) x 2 batch sizes x remat False, True
    assert {(c.batch_size, c.remat) for c in result.candidates} == {(16, False), (16, True), (64, False), (64, True)}
    assert result.memory_limit is None and all(c.fits and c.margin is None for c in result.candidates)
    by_key = {(c.layout.name, c.batch_size, c.remat): c for c in result.candidates}
    big, small = by_key[("mirrored", 64, False)], by_key[("mirrored", 16, False)]
    assert big.report.memory["temporaries"] > small.report.memory["temporaries"]  # activations grow with rows
    assert big.report.batch_size == 64

    candidate = by_key[("mirrored", 64, True)]
    with candidate.strategy().scope():
        model = mf.Model(lambda: Recorded(remat=True))
        model.compile(**COMPILE)
    rows = np.resize(x, (64, 32)), np.resize(y, (64,))
    assert model.step_report(*rows).memory["peak"] == pytest.approx(candidate.peak_bytes, rel=0.05)


@pytest.mark.slow
def test_a_layout_whose_rules_cannot_split_a_parameter_is_listed_as_not_compiling():
    x, y = classification_data(n=8, din=32, classes=10)
    rules = [(r"hidden/kernel", (None, "tensor"))]  # 5 hidden units do not split over 2 devices
    result = mf.plan(lambda: Recorded(hidden=5), x, y, compile=COMPILE, devices=jax.devices()[:2], rules=rules)
    failed = [c for c in result.candidates if c.error]
    assert {c.layout.name for c in failed} == {"tensor=2"} and result.compiled == 2
    assert result.candidates[-1] is failed[0] and not failed[0].fits
    assert "does not divide it" in failed[0].error and "does not compile" in str(result)


@pytest.mark.slow
def test_best_says_so_when_nothing_fits():
    x, y = classification_data(n=8, din=32, classes=10)
    result = mf.plan(lambda: Recorded(hidden=8), x, y, compile=COMPILE, devices=jax.devices()[:1], memory_limit=1)
    assert not any(c.fits for c in result.candidates)
    with pytest.raises(ValueError, match="No candidate fits in memory_limit=1 B per device"):
        _ = result.best


@pytest.mark.slow
def test_measure_times_the_best_predicted_with_real_steps_ranks_them_by_it_and_frees_them():
    x, y = classification_data(n=16, din=32, classes=10)
    Recorded.built.clear(), Recorded.calls.clear()
    gc.collect()  # what earlier tests left unreferenced goes now, not during the plan
    before = {id(a) for a in jax.live_arrays()}
    unmeasured = mf.plan(lambda: Recorded(hidden=64), x, y, compile=COMPILE, devices=jax.devices()[:2])
    assert unmeasured.measured == 0 and Recorded.calls == [] and "measure=K" in str(unmeasured)
    result = mf.plan(lambda: Recorded(hidden=64), x, y, compile=COMPILE, devices=jax.devices()[:2], measure=2)
    after = jax.live_arrays()
    # Each measured model, Adam and batch freed: nothing new is alive (arrays of earlier tests may have gone).
    assert {id(a) for a in after} <= before, [a.shape for a in after if id(a) not in before]
    assert Recorded.calls  # real steps ran (the parameters are made inside a jitted function: built stays False)

    first, second, third = result.candidates
    assert result.measured == 2 and third.measured_seconds is None
    assert first.measured_seconds > 0 and second.measured_seconds > 0
    assert first.measured_samples_per_second >= second.measured_samples_per_second  # ranked by what was measured
    best_predicted = {c.layout.name for c in unmeasured.candidates[:2]}
    assert {first.layout.name, second.layout.name} == best_predicted and result.best is first

    lines = str(result).splitlines()
    assert "3 candidates compiled, 2 measured, in" in lines[0]
    header = lines[1]
    assert "step ≥ (roofline)" in header and "step measured" in header
    at = header.index("step measured")
    rows = {line.split()[0]: line for line in lines[3:6]}
    assert set(rows) == {"mirrored", "fsdp=2", "tensor=2"}  # the layouts named by their axes
    assert rows[first.layout.name][at:].startswith(f"{first.measured_seconds * 1e3:,.2f} ms")
    assert rows[third.layout.name][at:].split()[0] == "≤"  # no measured time: blank, then the bound on samples/s
    assert lines[6].startswith("step ≥ (roofline): a lower bound") and "3 real steps each" in lines[7]


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_verbose_names_each_candidate_on_stderr_and_zero_shows_nothing(capfd):
    x, y = classification_data(n=8, din=32, classes=10)
    mf.plan(Recorded, x, y, compile=COMPILE, devices=jax.devices()[:1], batch_sizes=[8, 16], verbose=1)
    out, err = capfd.readouterr()
    assert out == ""
    for name in ("mirrored, batch 8, remat False", "mirrored, batch 16, remat True"):
        assert name in err
    assert "Compiling" in err
    mf.plan(Recorded, x, y, compile=COMPILE, devices=jax.devices()[:1], verbose=0)
    assert capfd.readouterr() == ("", "")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(compile="adam"), "`compile` takes the arguments of Model.compile"),
        (dict(memory_limit=-5), "`memory_limit` must be a positive number of bytes or None. Received: -5"),
        (dict(batch_sizes=[0]), r"`batch_sizes` must be positive ints. Received: batch_sizes=\[0\]"),
        (dict(remat=(False, True)), "this factory has none. Received: remat=\\(False, True\\)"),
        (dict(devices=[]), "Received: devices=\\[\\]"),
        (dict(measure=-1), "`measure` is how many .* an int >= 0. Received: measure=-1"),
        (dict(measure="2"), "Received: measure='2'"),
        (dict(verbose="yes"), "`verbose` must be 0, 1 or .auto.. Received: verbose=.yes."),
    ],
)
def test_bad_arguments_are_refused_before_anything_compiles(kwargs, message):
    x, y = classification_data(n=8, din=32, classes=10)
    Recorded.built.clear()
    arguments = dict(compile=COMPILE) | kwargs
    with pytest.raises(ValueError, match=message):
        mf.plan(lambda: Recorded(hidden=8), x, y, **arguments)
    assert Recorded.built == []


def test_stage_layouts_divide_the_layers_and_cut_the_batch_into_microbatches():
    """P divides the devices and every stack's layers; M, the largest divisor of a replica's rows up to 4P; each
    P gets GPipe, 1f1b and circular at the smallest and the largest v > 1 with P v dividing the layers."""
    found = {layout.name: layout for layout in stage_layouts(8, [8], batch_size=32)}
    assert list(found) == [
        "stage=2,data=4 gpipe M=8",
        "stage=2,data=4 1f1b M=8",
        "stage=2,data=4 circular M=8 v=2",
        "stage=2,data=4 circular M=8 v=4",  # v = 3 lies between: not proposed
        "stage=4,data=2 gpipe M=16",
        "stage=4,data=2 1f1b M=16",
        "stage=4,data=2 circular M=16 v=2",
        "stage=8 gpipe M=32",  # 8 layers on 8 stages: no circular
        "stage=8 1f1b M=32",
    ]
    assert [layout.name for layout in stage_layouts(8, [6], batch_size=32)] == [
        "stage=2,data=4 gpipe M=8",
        "stage=2,data=4 1f1b M=8",
        "stage=2,data=4 circular M=8 v=3",  # the only v > 1: smallest and largest at once, proposed once
    ]
    # Two stacks: 1f1b pipelines one, so only GPipe; 2 v divides 8 but not 6.
    assert [layout.name for layout in stage_layouts(8, [8, 6], batch_size=32)] == ["stage=2,data=4 gpipe M=8"]
    twelve = [layout.name for layout in stage_layouts(8, [8], batch_size=12)]
    assert twelve[:3] == ["stage=2,data=4 gpipe M=3", "stage=2,data=4 1f1b M=3", "stage=2,data=4 circular M=3 v=2"]
    assert [layout.name for layout in stage_layouts(8, [8], batch_size=30)] == [  # 30 rows do not split over 4
        "stage=4,data=2 gpipe M=15",
        "stage=4,data=2 1f1b M=15",
        "stage=4,data=2 circular M=15 v=2",
        "stage=8 gpipe M=30",
        "stage=8 1f1b M=30",
    ]
    # A circular pipeline needs M >= P: one row a replica at P = 2, two at P = 4, four at P = 8.
    assert not [layout for layout in stage_layouts(8, [16], batch_size=4) if layout.pipeline.schedule == "circular"]
    assert stage_layouts(8, [], batch_size=32) == []  # no Stages: no stage layout
    strategy = found["stage=4,data=2 gpipe M=16"].strategy(jax.devices())
    assert strategy.stages == 4 and strategy.pipeline == mf.strategies.Pipeline(microbatches=16)
    circular = found["stage=2,data=4 circular M=8 v=4"].strategy(jax.devices())
    assert circular.pipeline == mf.strategies.Pipeline(microbatches=8, schedule="circular", repeats=4)


class Staged(nnx.Module):
    def __init__(self, layers=4):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Linear(32, 16, rngs=rngs)
        self.body = Stages(ResidualBlock, layers, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(self.body(self.embed(x)))


@pytest.mark.slow
def test_a_model_on_stages_is_planned_with_stage_layouts_and_their_pipeline_cost():
    x, y = classification_data(n=16, din=32, classes=10)
    result = mf.plan(Staged, x, y, compile=dict(optimizer="sgd", loss=COMPILE["loss"]), devices=jax.devices()[:2])
    names = {c.layout.name: c for c in result.candidates}
    schedules = {"stage=2 gpipe M=8", "stage=2 1f1b M=8", "stage=2 circular M=8 v=2"}
    assert set(names) == {"mirrored", "fsdp=2", "tensor=2"} | schedules and result.compiled == 6
    staged = names["stage=2 gpipe M=8"]
    cost = staged.report.pipeline
    assert cost.bubble == pytest.approx(1 / 9)  # (P - 1) / (M + P - 1)
    assert cost.p2p_bytes == 2 * 9 * (16 // 8) * 16 * 4  # forward and backward, 9 ticks, 2 rows of 16 floats
    assert cost.stage_param_bytes == 2 * (16 * 32 + 32 + 32 * 16 + 16) * 4  # 2 of the 4 layers
    # A pass: 2 rows through 2 layers, each keeping 16 + 32 + 32 floats a row; GPipe keeps every tick's.
    assert cost.pass_residual_bytes == 2 * 2 * 80 * 4 and cost.kept_passes == 9
    one_f_one_b, circular = names["stage=2 1f1b M=8"].report.pipeline, names["stage=2 circular M=8 v=2"].report.pipeline
    assert one_f_one_b.kept_passes == 3 and one_f_one_b.activation_bytes == 3 * cost.pass_residual_bytes  # 2P - 1
    assert circular.kept_passes == 2 * 8 + 1 and circular.bubble == pytest.approx(1 / 17)  # a round: 1 layer
    assert all(c.report.pipeline is None for c in result.candidates if c.layout.name not in schedules)
    text = str(result)
    assert "bubble" in text.splitlines()[1] and "kept act (passes)" in text.splitlines()[1]
    row = next(line for line in text.splitlines() if line.startswith("stage=2 gpipe"))
    assert "11.1%" in row and "2.2 KiB" in row and "8.4 KiB" in row and "11.2 KiB (9)" in row
    assert "3.8 KiB (3)" in next(line for line in text.splitlines() if line.startswith("stage=2 1f1b"))
    assert staged.strategy().pipeline == mf.strategies.Pipeline(microbatches=8)
    assert planner._stage_layers(Staged, None) == [4] and planner._stage_layers(Recorded, False) == []


#: A device whose FLOP/s are all that limit a step: the roofline's time is compute alone.
COMPUTE_BOUND = DeviceSpec(peak_flops=1e9, memory_bandwidth=1e18, interconnect_bandwidth=1e18)


@pytest.mark.slow
@eight_devices
def test_on_eight_devices_every_schedule_is_proposed_and_where_compute_binds_circular_leads():
    """Every candidate fits (no limit on CPU); with compute all that counts, the pipeline with the smallest bubble,
    circular, ranks first of the pipelines: a step's FLOPs count the ticks its stages idle."""
    x, y = classification_data(n=16, din=32, classes=10)
    compile_args = dict(optimizer="sgd", loss=COMPILE["loss"])
    result = mf.plan(Staged, x, y, compile=compile_args, device_spec=COMPUTE_BOUND)
    pipelined = [c for c in result.candidates if c.layout.pipeline is not None]
    by_name = {c.layout.name: c for c in pipelined}
    assert set(by_name) == {
        "stage=2,data=4 gpipe M=4",
        "stage=2,data=4 1f1b M=4",
        "stage=2,data=4 circular M=4 v=2",
        "stage=4,data=2 gpipe M=8",  # 4 layers on 4 stages: no circular
        "stage=4,data=2 1f1b M=8",
    }
    assert result.compiled == len(result.candidates) == 10 + 5 and all(c.fits for c in result.candidates)
    for c in pipelined:
        pipeline, cost = c.layout.pipeline, c.report.pipeline
        assert cost.bubble == pipeline.bubble(cost.stages) and cost.schedule == pipeline.schedule
        expected = min(2 * cost.stages - 1, pipeline.microbatches) if pipeline.schedule == "1f1b" else None
        assert cost.kept_passes == (expected or pipeline.ticks(cost.stages))
        assert c.time == roofline.step_time(c.report, COMPUTE_BOUND) and c.time.bound == "compute"

    circular = by_name["stage=2,data=4 circular M=4 v=2"]
    assert circular.report.pipeline.bubble == pytest.approx(1 / 9)  # against GPipe's and 1f1b's 1 / 5
    assert circular.report.flops < by_name["stage=2,data=4 gpipe M=4"].report.flops  # fewer idle ticks' work
    assert pipelined[0] is circular  # the fastest pipeline
    text = str(result)
    row = next(line for line in text.splitlines() if line.startswith("stage=2,data=4 circular M=4 v=2"))
    assert "11.1%" in row and "(9)" in row  # bubble 1 / (2 x 4 + 1); 2 x 4 + 1 passes kept


class Wide(nnx.Module):
    """A block whose activations outweigh its input: 16 -> 512 -> 16."""

    def __init__(self, rngs):
        self.up = nnx.Linear(16, 512, rngs=rngs)
        self.down = nnx.Linear(512, 16, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class WideStaged(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Linear(32, 16, rngs=rngs)
        self.body = Stages(Wide, 2, rngs=rngs)  # 2 layers on 2 stages: no circular, GPipe and 1f1b only
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(self.body(self.embed(x)))


@pytest.mark.slow
def test_where_activations_bind_memory_a_1f1b_candidate_fits_and_is_picked_over_gpipe():
    """Under a limit of exactly the 1f1b candidate's peak (3 microbatch passes kept, not GPipe's 9), it fits,
    GPipe and the unpipelined layouts (every row's activations at once) do not, and it is the plan's pick."""
    x, y = classification_data(n=16, din=32, classes=10)
    compile_args = dict(optimizer="sgd", loss=COMPILE["loss"])
    devices = jax.devices()[:2]
    one_f_one_b = Layout((("stage", 2), ("data", 1)), mf.strategies.Pipeline(microbatches=8, schedule="1f1b"))
    with one_f_one_b.strategy(devices).scope():
        model = mf.Model(WideStaged, abstract=True)
        model.compile(**compile_args)
    limit = model.step_report(np.resize(x, (512, 32)), np.resize(y, (512,))).memory["peak"]

    result = mf.plan(WideStaged, x, y, compile=compile_args, devices=devices, batch_sizes=[512], memory_limit=limit)
    by_name = {c.layout.name: c for c in result.candidates}
    assert set(by_name) == {"mirrored", "fsdp=2", "tensor=2", "stage=2 gpipe M=8", "stage=2 1f1b M=8"}
    best, gpipe = result.best, by_name["stage=2 gpipe M=8"]
    assert best.layout == one_f_one_b and best.peak_bytes == limit and best.margin == 0
    assert not gpipe.fits and gpipe.peak_bytes > limit and result.candidates.index(gpipe) > 0
    assert best.report.pipeline.kept_passes == 3 and gpipe.report.pipeline.kept_passes == 9
    assert best.report.pipeline.activation_bytes < gpipe.report.pipeline.activation_bytes
    assert [c.fits for c in result.candidates] == [True, False, False, False, False]


def mean_cross_entropy(y_true, y_pred):
    """A loss that returns the batch's mean: a scalar, not a sum over rows."""
    return optax.softmax_cross_entropy_with_integer_labels(y_pred, y_true).mean()


@pytest.mark.slow
def test_a_1f1b_candidate_the_loss_rules_out_is_listed_as_not_compiling_with_the_reason():
    x, y = classification_data(n=16, din=32, classes=10)
    result = mf.plan(
        lambda: Staged(layers=2),
        x,
        y,
        compile=dict(optimizer="sgd", loss=mean_cross_entropy),
        devices=jax.devices()[:2],
    )
    failed = result.candidates[-1]
    assert failed.layout.name == "stage=2 1f1b M=8" and failed.report is None and not failed.fits
    assert "must be a sum over rows" in failed.error and result.compiled == 4  # the rest compiled
    assert all(c.error is None for c in result.candidates[:-1])
    text = str(result)
    assert "stage=2 1f1b M=8" in text and "does not compile" in text
    assert "Did not compile: stage=2 1f1b M=8: The 1f1b schedule computes the loss per microbatch" in text
