"""A pipeline's settings: how a `MeshStrategy` with a `stage` axis runs a model's `meshfit.pipeline.Stages`.

The `stage` mesh axis splits the layer axis of a `Stages` stack in contiguous
blocks, one per stage; a batch is cut into `microbatches` that flow through the
stages, each stage passing its output to the next (`jax.lax.ppermute`).
Schedules:
  * "gpipe": every microbatch forward, then every one backward (what autodiff
    of the forward loop gives); a stage keeps the activations of all M.
  * "circular": each stage runs `repeats` groups of layers, a microbatch
    going round the ring `repeats` times; the bubble shrinks to
    (P - 1) / (repeats * M + P - 1). Stage s runs layer groups s, s + P, ...:
    the stack is stored repeat-major so they lie on its devices, and no step
    moves parameters (`meshfit.pipeline.layer_stacks`).
  * "1f1b": the built-in train step runs the layers after the stack (the
    tail) and the loss inside the last stage, one microbatch at a time, so a
    backward starts as soon as a microbatch leaves the stack: a forward and a
    backward each tick once the pipeline is full. The same work and bubble as
    GPipe; a stage keeps the residuals of at most 2P - 1 microbatches, not M
    (see `meshfit.pipeline.one_f_one_b`). Evaluation and prediction run the
    GPipe forward.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The mesh axis that splits a `Stages` stack's layer axis.
STAGE_AXIS = "stage"
SCHEDULES = ("gpipe", "circular", "1f1b")


@dataclass(frozen=True)
class Pipeline:
    """How the stages of a `stage` mesh axis share the work of a step.

    Args:
        microbatches: M, the number of parts each data replica's rows are cut into.
        schedule: "gpipe", "circular" or "1f1b" (see the module docstring).
        repeats: v, the layer groups each stage runs per microbatch (circular only).

    Example:
        >>> strategy = MeshStrategy(axes={"stage": 4, "data": 2},
        ...                         pipeline=Pipeline(microbatches=8, schedule="circular", repeats=2))
    """

    microbatches: int
    schedule: str = "gpipe"
    repeats: int = 1

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Pipeline `schedule` must be one of {SCHEDULES}. Received: schedule={self.schedule!r}.")
        for name, meaning in (("microbatches", "parts each replica's rows are cut into"), ("repeats", "rounds")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # (True is an int to Python)
                raise ValueError(
                    f"Pipeline `{name}` must be a positive int (the number of {meaning}). "
                    f"Received: {name}={value!r} ({type(value).__name__})."
                )
        if self.repeats > 1 and self.schedule != "circular":
            raise ValueError(
                f"Pipeline `repeats` > 1 needs schedule='circular'. Received: schedule={self.schedule!r}, "
                f"repeats={self.repeats}."
            )

    def bubble(self, stages: int) -> float:
        """The fraction of a step's ticks a stage idles: (P - 1) / (repeats * M + P - 1).

        It is also the fraction of each device's matmul work spent in idle ticks, for every schedule:
        "1f1b" runs P - 1 forward-only ticks, M ticks of both and P - 1 backward-only ticks, the
        GPipe count (`meshfit.pipeline.one_f_one_b`; its tail runs on the last stage on top, the others
        waiting for it).
        """
        return (stages - 1) / (self.repeats * self.microbatches + stages - 1)

    def ticks(self, stages: int) -> int:
        """Forward ticks of one step: repeats * M + P - 1."""
        return self.repeats * self.microbatches + stages - 1

    def check(self, stages: int) -> None:
        """Raises if this schedule cannot run on `stages` stages.

        A circular pipeline needs M >= P at any `repeats`: a microbatch must be back at the first stage
        before its next round, and the schedule is documented (and planned) with that bound even where
        one round (repeats=1) could run with fewer.
        """
        if self.schedule == "circular" and self.microbatches < stages:
            raise ValueError(
                f"A circular pipeline needs at least as many microbatches as stages ({stages}), so a microbatch "
                f"is back at the first stage before its next round. Received: microbatches={self.microbatches} "
                f"(repeats={self.repeats}). Use microbatches >= {stages}, or schedule='gpipe'."
            )

    def check_batch_size(self, batch_size: int, replicas: int) -> None:
        """Raises unless a global batch of `batch_size` rows cuts into M whole microbatches per data replica.

        A replica's rows are `batch_size / replicas`, rounded up (the batch is padded to whole replicas, as
        under any data-parallel strategy). A batch size that leaves a microbatch short is refused rather
        than padded: the padding rows would cost a step's compute in every microbatch, unseen.
        """
        rows = -(-batch_size // replicas)
        if rows % self.microbatches:
            raise ValueError(
                f"Pipeline microbatches={self.microbatches} must divide each data replica's rows. Received: "
                f"batch_size={batch_size}, {rows} rows a replica over {replicas} replicas. Use a batch_size "
                f"that is a multiple of {replicas * self.microbatches} (replicas x microbatches)."
            )

    def check_layers(self, layers: int, stages: int, where: str = "Stages") -> None:
        """Raises if `layers` do not split evenly over `stages` stages (times `repeats`)."""
        groups = stages * self.repeats
        if layers % groups:
            by = f"stages x repeats = {stages} x {self.repeats} = {groups}" if self.repeats > 1 else f"{stages} stages"
            raise ValueError(
                f"{where} holds {layers} layers, which do not split over {by}. "
                f"Use a number of layers divisible by {groups}, or change the `stage` axis or `repeats`."
            )
