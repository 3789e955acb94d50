"""The pipeline is a library below the strategies: it imports none of them, and a strategy's scope hands `Stages`
the stage layout it runs on."""

import subprocess
import sys

import pytest

import meshfit as mf
from meshfit.pipeline import stage_layout

pytestmark = pytest.mark.processes  # starts real processes: the tier CI runs after the README's

PIPELINE = ("capture", "layer_stacks", "one_f_one_b", "schedules", "settings", "stage_layout", "stages", "vma")
ABOVE = ("strategies", "steps", "training", "model", "callbacks")


def test_the_pipeline_modules_load_no_strategy_step_or_training_module():
    imports = "; ".join(f"import meshfit.pipeline.{name}" for name in PIPELINE)
    code = f"{imports}; import sys; print(sorted(m for m in sys.modules if m.startswith('meshfit.')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = eval(result.stdout)
    assert "meshfit.pipeline.one_f_one_b" in loaded
    assert [m for m in loaded if m.split(".")[1] in ABOVE] == []


def test_a_strategys_scope_sets_its_stage_layout_and_a_nested_scope_its_own():
    strategy = mf.strategies.MeshStrategy(
        axes={"stage": 4, "data": 2}, pipeline=mf.strategies.Pipeline(microbatches=4, schedule="1f1b")
    )
    assert stage_layout.current() is None
    with strategy.scope():
        layout = stage_layout.current()
        assert layout == strategy.stage_layout and layout.stages == 4
        assert (layout.replicas, layout.data_axes, layout.pipeline.schedule) == (2, ("data",), "1f1b")
        with mf.strategies.OneDeviceStrategy().scope():
            assert stage_layout.current() is None  # a Stages stack created or called here runs in one scan
        assert stage_layout.current() == layout
    assert stage_layout.current() is None
    assert mf.strategies.MeshStrategy(axes={"data": 8}).stage_layout is None


def test_the_whole_copy_axes_stop_at_the_fsdp_axis():
    strategy = mf.strategies.MeshStrategy(axes={"data": 2, "fsdp": 2, "stage": 2}, batch_axes=("data", "fsdp"))
    assert strategy.stage_layout.data_axes == ("data",)  # along fsdp a stage's parameters are split, not copied
