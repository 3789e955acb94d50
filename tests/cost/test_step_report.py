"""`model.step_report()`: FLOPs, memory and collectives of the compiled train step, read from XLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import MLP, ResidualBlock, classification_data

import meshfit as mf
from meshfit.cost import step_report
from meshfit.cost.step_report import jaxpr_flops
from meshfit.cost.summary import format_step_report
from meshfit.pipeline import Stages

eight_devices = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (simulated on a CPU)")


def fitted(strategy=None):
    x, y = classification_data(n=256, din=32, classes=10)
    with (strategy or mf.strategies.OneDeviceStrategy()).scope():
        model = mf.Model(MLP(din=32, hidden=128, dout=10))
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return model


@pytest.mark.slow
def test_step_report_counts_about_six_flops_per_parameter_and_sample():
    model = fitted()
    report = model.step_report()
    assert report.batch_size == 32 and report.num_devices == 1
    assert 0.5 < report.flops_per_sample / (6 * model.count_params()) < 2  # forward 2x, backward 4x
    assert report.memory["arguments"] > 0
    assert report.bytes_accessed > 0 or jax.default_backend() == "gpu"  # the CUDA plugin gives no estimate


@pytest.mark.slow
@eight_devices
def test_step_report_is_per_device_under_data_parallelism():
    one = fitted().step_report()
    eight = fitted(strategy=mf.strategies.MirroredStrategy()).step_report()
    assert eight.num_devices == 8 and eight.batch_size == 32
    assert eight.flops == pytest.approx(one.flops / 8, rel=0.05)  # the same step's FLOPs, over 8 devices
    assert eight.flops_per_sample == pytest.approx(one.flops_per_sample, rel=0.05)


def test_step_report_needs_a_built_model():
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="call fit\\(\\) or evaluate\\(\\) on data first"):
        model.step_report()


def test_the_jaxpr_count_agrees_with_xla_where_both_exist():
    """The FLOP count used where a backend has no cost analysis of a lowered program (the CUDA plugin)."""
    model = fitted()
    session = model.session
    batch = session.strategy.distribute_batch(model.session.example_batch, False)
    counted = jaxpr_flops(jax.make_jaxpr(session.steps.train_step)(session.state, batch))
    assert counted == pytest.approx(model.step_report().flops, rel=0.2)  # no elementwise work: ~13 % here


def test_memory_adds_up_and_summary_prints_it():
    model = fitted()
    memory = model.step_report().memory
    assert set(memory) == {"arguments", "outputs", "temporaries", "aliased", "peak"}
    assert memory["peak"] == memory["arguments"] + memory["outputs"] + memory["temporaries"] - memory["aliased"]
    assert memory["aliased"] > 0  # the state is donated: the new state reuses its buffers
    text = model.summary(print_fn=None)
    assert f"Train step (batch 32; per device, 1 x {jax.devices()[0].device_kind})" in text
    assert "Collectives" not in text


class Wide(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.a = nnx.Linear(256, 512, rngs=rngs)
        self.b = nnx.Linear(512, 256, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.relu(self.a(x)))


@pytest.mark.slow
@eight_devices
def test_a_batch_is_costed_before_any_training():
    """`step_report(x, y)` compiles for that batch and runs nothing: whether a layout fits, known up front."""
    x, y = np.zeros((64, 256), np.float32), np.zeros((64, 256), np.float32)
    reports = {}
    for name, strategy in [
        ("mirrored", mf.strategies.MirroredStrategy()),
        ("fsdp", mf.strategies.MeshStrategy(axes={"fsdp": 8})),
    ]:
        with strategy.scope():
            model = mf.Model(Wide())
            model.compile(optimizer="adam", loss="mse")
        before = model.get_weights()
        reports[name] = report = model.step_report(x, y)
        assert report.batch_size == 64 and report.num_devices == 8
        assert model.session.step == 0
        for a, b in zip(before, model.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
        state_bytes = sum(a.nbytes for a in jax.tree.leaves(model.session.latest))
        reports[name + "_state"] = state_bytes
    batch_bytes = x.nbytes + y.nbytes
    fsdp = reports["fsdp"]
    assert fsdp.memory["arguments"] <= 1.2 * reports["fsdp_state"] / 8 + batch_bytes
    assert fsdp.memory["peak"] < reports["mirrored"].memory["peak"]
    assert "all-gather" in fsdp.collectives  # parameters gathered for the forward pass
    assert set(reports["mirrored"].collectives) == {"all-reduce"}


def test_needs_targets_with_a_batch():
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="needs targets `y`"):
        model.step_report(np.zeros((8, 4), np.float32))


@eight_devices
def test_collective_bytes_are_read_from_the_compiled_program():
    """Each kind's operand bytes per device, against a shard_map program written with all five kinds."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
    P = jax.sharding.PartitionSpec

    def body(x):  # x: this device's (4, 16) float32 block: 256 bytes
        total = jax.lax.psum(x, "i")  # all-reduce: 256
        gathered = jax.lax.all_gather(x, "i", tiled=True)  # all-gather: 256 in
        scattered = jax.lax.psum_scatter(gathered, "i", tiled=True)  # reduce-scatter: 2048 in
        swapped = jax.lax.all_to_all(x.reshape(8, 8), "i", 0, 0, tiled=True)  # all-to-all: 256
        shifted = jax.lax.ppermute(x, "i", [(j, (j + 1) % 8) for j in range(8)])  # collective-permute: 256
        return total + scattered + swapped.reshape(4, 16) + shifted

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    x = np.ones((32, 16), np.float32)
    lowered = fn.lower(x)
    compiled = step_report.compiled_collectives(lowered.compile().as_text())
    written = step_report.lowered_collectives(lowered)
    expected = {
        "all-reduce": 256,
        "all-gather": 256,
        "reduce-scatter": 2048,
        "all-to-all": 256,
        "collective-permute": 256,
    }
    assert written == expected
    assert compiled == expected


@pytest.mark.parametrize(
    "line, kind, size",
    [  # forms XLA prints for GPUs: asynchronous starts, iota replica groups, bf16
        (  # XLA:GPU (jax 0.11.2, H200): a bf16-compressed gradient all-reduce, operands then results
            "%all-reduce-start.2 = ((bf16[669706]{0}), bf16[669706]{0}) all-reduce-start(%wrapped_concatenate.1), "
            "channel_id=1, replica_groups={{0}}, use_global_device_ids=true, to_apply=%region_10.17",
            "all-reduce",
            669706 * 2,
        ),
        (
            "%all-reduce-start = bf16[1024,256]{1,0} all-reduce-start(bf16[1024,256]{1,0} %p), replica_groups={{0,1}}",
            "all-reduce",
            1024 * 256 * 2,
        ),
        (
            "%ag = (f32[128]{0}, f32[1024]{0}) all-gather-start(f32[128]{0} %p), replica_groups=[1,8]<=[8]",
            "all-gather",
            128 * 4,
        ),
        (  # the mesh form of replica groups (XLA in jax 0.11): groups over 'fsdp' of a 2 x 4 mesh
            "%ag.3 = f32[32,16]{1,0} all-gather(%p), channel_id=1, replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}",
            "all-gather",
            32 * 16 * 4 // 4,
        ),
        (
            "%rs = f32[128]{0} reduce-scatter(f32[1024]{0} %p), replica_groups=[1,8]<=[8], dimensions={0}",
            "reduce-scatter",
            1024 * 4,
        ),
        (
            "%cp = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(f32[64]{0} %p), channel_id=3",
            "collective-permute",
            64 * 4,
        ),
    ],
)
def test_asynchronous_and_grouped_forms(line, kind, size):
    assert step_report.compiled_collectives(line) == {kind: size}
    if "-start(" in line:  # the matching done returns the results: not counted again
        assert step_report.compiled_collectives(line.replace("-start(", "-done(")) == {}


class Staged(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Linear(8, 16, rngs=rngs)
        self.body = Stages(ResidualBlock, 8, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(self.body(self.embed(x)))


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@eight_devices
@pytest.mark.parametrize("schedule, repeats", [("gpipe", 1), ("circular", 2), ("1f1b", 1)])
def test_a_pipelined_step_reports_its_stage_cost(schedule, repeats):
    """Bubble, point-to-point bytes, a stage's parameters and kept activations, against a hand count."""
    stages, data, micro, batch = 4, 2, 4, 32
    pipeline = mf.strategies.Pipeline(microbatches=micro, schedule=schedule, repeats=repeats)
    with mf.strategies.MeshStrategy(axes={"stage": stages, "data": data}, pipeline=pipeline).scope():
        model = mf.Model(Staged)
        model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.zeros((batch, 8), np.float32), np.zeros((batch,), np.int32)
    cost = model.step_report(x, y).pipeline
    rows = batch // (data * micro)  # a microbatch's rows on one device
    sent = rows * 16 * 4  # what one tick sends: 256 bytes
    ticks = repeats * micro + stages - 1
    assert cost.bubble == pytest.approx((stages - 1) / ticks)
    assert cost.microbatch_bytes == sent
    # A forward and a backward send a tick each: GPipe's two loops, or 1f1b's warm-up (P - 1 forward),
    # steady (M ticks of both) and cool-down (P - 1 backward) phases.
    assert cost.p2p_bytes == 2 * ticks * sent
    block = (16 * 32 + 32 + 32 * 16 + 16) * 4
    assert cost.stage_param_bytes == 8 * block // stages  # one stage's layers, not the stack
    layers = 8 // (stages * repeats)  # a stage's layers of one round
    if schedule == "circular":  # its jax.checkpoint saves the round's input and each block's matmul outputs
        assert cost.pass_residual_bytes == rows * (16 + layers * (32 + 16)) * 4
    else:  # each block's input, tanh's output and its derivative
        assert cost.pass_residual_bytes == layers * rows * (16 + 32 + 32) * 4
    if schedule == "1f1b":  # the stashed residuals of min(2P - 1, M) passes
        assert cost.activation_bytes == min(2 * stages - 1, micro) * cost.pass_residual_bytes
    else:  # every forward tick's pass
        assert cost.activation_bytes == ticks * cost.pass_residual_bytes
    text = format_step_report(model.step_report(x, y))
    assert f"Pipeline (4 stages, 4 microbatches, {schedule}" in text
    assert f"bubble {cost.bubble:.1%}" in text


def test_an_unpipelined_step_has_no_pipeline_cost():
    model = mf.Model(MLP(din=8, hidden=16, dout=4))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    report = model.step_report(np.zeros((8, 8), np.float32), np.zeros((8,), np.int32))
    assert report.pipeline is None
    assert "Pipeline" not in format_step_report(report)


# -- loops by their trip counts -------------------------------------------------------------------

WIDTH, ROWS = 128, 32
MATMUL = 2 * ROWS * WIDTH * WIDTH  # one (32, 128) x (128, 128) product


def reported(fn, *args, devices=None):
    """`step_report.analyse` of a jitted function, as `Model.step_report` reads a train step."""
    lowered = jax.jit(fn).lower(*args)
    jaxpr = lambda: jax.make_jaxpr(fn)(*args)  # noqa: E731
    return step_report.analyse(lowered, lowered.compile(), ROWS, devices or jax.devices()[:1], jaxpr)


def matrices():
    return np.ones((ROWS, WIDTH), np.float32), np.full((WIDTH, WIDTH), 0.01, np.float32)


@pytest.mark.parametrize("unroll, xla_copies", [(1, 1), (3, 3 + 8 % 3)])
def test_a_scan_counts_its_body_length_times(unroll, xla_copies):
    """XLA's cost analysis counts a loop's body once (an unrolled scan's copies and remainder); the report K times."""

    def scanned(x, w):
        return jax.lax.scan(lambda h, _: (h @ w, None), x, None, length=8, unroll=unroll)[0]

    x, w = matrices()
    lowered = jax.jit(scanned).lower(x, w)
    assert lowered.cost_analysis()["flops"] == pytest.approx(xla_copies * MATMUL, rel=0.01)  # what XLA counts
    report = reported(scanned, x, w)
    assert report.flops == pytest.approx(8 * MATMUL, rel=0.02)
    assert report.device_flops == pytest.approx(8 * MATMUL, rel=0.02)
    assert report.redundant_flops == 0


def test_nested_loops_and_a_static_while_count_every_trip():
    def nested(x, w):
        inner = lambda h: jax.lax.scan(lambda g, _: (g @ w, None), h, None, length=3)[0]  # noqa: E731
        h = jax.lax.scan(lambda h, _: (inner(h), None), x, None, length=4)[0]
        return jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] @ w), (0, h))[1]

    assert reported(nested, *matrices()).flops == pytest.approx((4 * 3 + 5) * MATMUL, rel=0.02)


def test_an_unlooped_step_keeps_xlas_figure():
    """What MFU is computed from does not move for a step without loops or shard_map: XLA's count, as it was."""
    model = fitted()
    session = model.session
    batch = session.strategy.distribute_batch(session.example_batch, False)
    xla = jax.jit(session.steps.train_step).lower(session.state, batch).cost_analysis()["flops"]
    report = model.step_report()
    assert report.flops == xla and report.redundant_flops == 0


@eight_devices
@pytest.mark.parametrize("masked", ["where", "cond"])
def test_work_a_device_throws_away_is_named_not_counted(masked):
    """A tail every device computes and only the last keeps (`jnp.where` on its position, as 1f1b's loop had it)
    is `redundant_flops`; under a `lax.cond` on the position only the last runs it. Both report the same `flops`."""
    devices = jax.devices()[:4]
    mesh = jax.sharding.Mesh(np.array(devices), ("stage",))
    P = jax.sharding.PartitionSpec

    def body(x, w, head):
        last = jax.lax.axis_index("stage") == 3

        def tick(h, _):
            h = jnp.tanh(h @ w)
            if masked == "where":
                out = jnp.where(last, h @ head, 0.0)
            else:
                out = jax.lax.cond(last, lambda h: h @ head, lambda h: jnp.zeros((ROWS, 4 * WIDTH)), h)
            return h, out.sum()

        return jax.lax.scan(tick, x, None, length=6)[1].sum(keepdims=True)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P("stage"))
    x, w = matrices()
    head = np.full((WIDTH, 4 * WIDTH), 0.01, np.float32)
    report = reported(fn, x, w, head, devices=devices)
    tail = 4 * MATMUL  # the head's product: 4x one step's
    useful = 6 * (4 * MATMUL + tail)  # six ticks of the step on every device, the tail on the last only
    assert report.flops * 4 == pytest.approx(useful, rel=0.05)
    assert report.redundant_flops * 4 == (6 * 3 * tail if masked == "where" else 0)
    assert ("run redundantly" in format_step_report(report)) == (masked == "where")


class Dense(nnx.Module):
    """A 256 x 256 block for `Stages`."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(256, 256, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x))


class LargeHead(nnx.Module):
    """8 blocks in `Stages`, then a 256 x 4096 head: twice the blocks' work, run by the tail under 1f1b."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.body = Stages(Dense, 8, rngs=rngs)
        self.head = nnx.Linear(256, 4096, rngs=rngs)

    def __call__(self, x):
        return self.head(self.body(x))


@eight_devices
def test_every_schedule_reports_the_same_useful_flops():
    """GPipe, circular and 1f1b run the same model: their FLOPs agree within the bubble's share of the blocks
    (idle ticks run too), where XLA alone counted each tick loop's body once (gpipe 52 M, 1f1b 5 M per device)."""
    batch = 64
    x, y = np.zeros((batch, 256), np.float32), np.zeros((batch,), np.int32)
    blocks, head = 3 * 8 * 2 * 256 * 256 * batch / 8, 3 * 2 * 256 * 4096 * batch / 8  # forward and backward
    reports = {}
    for schedule, repeats in [("gpipe", 1), ("circular", 2), ("1f1b", 1)]:
        pipeline = mf.strategies.Pipeline(microbatches=8, schedule=schedule, repeats=repeats)
        with mf.strategies.MeshStrategy(axes={"stage": 4, "data": 2}, pipeline=pipeline).scope():
            model = mf.Model(LargeHead)
            model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        reports[schedule] = report = model.step_report(x, y)
        ticks = (repeats * 8 + 3) / (repeats * 8)  # the blocks' work with the bubble's ticks
        assert blocks * ticks + head < report.flops < 1.1 * (blocks * ticks + head), schedule  # + elementwise work
        if schedule == "1f1b":  # its tail: under a cond on the last stage, or on every stage and kept on the last
            assert report.redundant_flops in (0, pytest.approx(3 * head)), report.redundant_flops
        else:
            assert report.redundant_flops == 0
    flops = [r.flops for r in reports.values()]
    assert max(flops) < 1.1 * min(flops), flops


@eight_devices
def test_an_explicit_data_parallel_step_counts_every_replica():
    """Under `reduction="explicit"` the gradients run in a `shard_map` over the replicas, which XLA counts once at one
    replica's shapes: the report counts it on every replica, as GSPMD's step is counted."""
    x, y = classification_data(n=64, din=32, classes=10)
    flops = {}
    for reduction in ("auto", "explicit"):
        with mf.strategies.MirroredStrategy(reduction=reduction).scope():
            model = mf.Model(MLP(din=32, hidden=128, dout=10))
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        flops[reduction] = model.step_report(x, y).flops
    assert flops["explicit"] == pytest.approx(flops["auto"], rel=0.1), flops
