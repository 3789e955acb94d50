"""Context parallelism on CPU: activation memory and K/V bytes per device, ring vs all-gather vs none.

A small causal LM (embeddings, `--layers` attention + MLP blocks attending through
`mf.layers.dot_product_attention`) is compiled for one training step at each
sequence length of `--seqs`, on the same global batch of `--rows` sequences (2:
long sequences come few to a batch), under four layouts of 8 devices, and
`model.step_report` reads the compiled program (nothing runs):

  * `data=8`: no context parallelism, each device a whole sequence (the batch padded to a row a device);
  * `ring`: `context=4, data=2`, ring attention (K/V blocks passed around the axis);
  * `all_gather`: `context=4, data=2`, every device gathers the whole K and V;
  * `gspmd`: `context=4, data=2`, `context_parallel=None`: attention left to XLA's partitioner.

Printed per layout and length: temporaries per device (activations kept for the
backward and scratch) and their ratio to `data=8`'s, the peak, and the K/V bytes
the attention sends per device per step (`StepReport.context`); `gspmd`'s
collectives are GSPMD's own, from the compiled program.

    python benchmarks/bench_context.py [--seqs 512,2048] [--width 64] [--layers 2] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from smoke import parse_args  # noqa: E402

import meshfit as mf  # noqa: E402

VOCAB, HEADS = 256, 4

LAYOUTS = {
    "data=8": ({"data": 8}, "ring"),
    "ring": ({"context": 4, "data": 2}, "ring"),
    "all_gather": ({"context": 4, "data": 2}, "all_gather"),
    "gspmd": ({"context": 4, "data": 2}, None),
}


class Block(nnx.Module):
    def __init__(self, width: int, context_parallel: str | None, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(width, rngs=rngs), nnx.LayerNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(width, width, rngs=rngs)
        self.up, self.down = nnx.Linear(width, 4 * width, rngs=rngs), nnx.Linear(4 * width, width, rngs=rngs)
        self.context_parallel = context_parallel

    def __call__(self, h):
        b, s, w = h.shape
        q, k, v = jnp.split(self.qkv(self.norm1(h)).reshape(b, s, 3 * HEADS, w // HEADS), 3, axis=2)
        a = mf.layers.dot_product_attention(q, k, v, causal=True, context_parallel=self.context_parallel)
        h = h + self.out(a.reshape(b, s, w))
        return h + self.down(nnx.gelu(self.up(self.norm2(h))))


class LM(nnx.Module):
    def __init__(self, seq: int, width: int, layers: int, context_parallel: str | None, rngs: nnx.Rngs):
        self.embed, self.position = nnx.Embed(VOCAB, width, rngs=rngs), nnx.Embed(seq, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, context_parallel, rngs) for _ in range(layers)])
        self.head = nnx.Linear(width, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens) + self.position(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def report(layout: str, seq: int, width: int, layers: int, rows: int):
    axes, context_parallel = LAYOUTS[layout]
    strategy = mf.strategies.MeshStrategy(axes=axes)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(rows, seq + 1)).astype(np.int32)
    with strategy.scope():
        model = mf.Model(lambda: LM(seq, width, layers, context_parallel, nnx.Rngs(0)))
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model.step_report(tokens[:, :-1], tokens[:, 1:])


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="512,2048", help="sequence lengths, comma-separated (multiples of 8)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=2, help="sequences in the global batch")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"some of {', '.join(LAYOUTS)}")
    args = parse_args(parser, argv, seqs="64", width=16, layers=1, layouts="data=8,ring")
    layouts = args.layouts.split(",")
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        parser.error(f"--layouts takes some of {', '.join(LAYOUTS)}. Received: {unknown}.")
    print(f"global batch {args.rows} rows, width {args.width}, {HEADS} heads, {args.layers} layers; per device, MiB")
    print("| seq | layout | temporaries | vs data=8 | peak | K/V sent by attention | collectives (compiled) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seq in (int(s) for s in args.seqs.split(",")):
        base = None
        for layout in layouts:
            r = report(layout, seq, args.width, args.layers, args.rows)
            temps = r.memory["temporaries"]
            base = temps if base is None else base
            kv = "-" if r.context is None or layout == "gspmd" else mib(r.context.kv_bytes)
            compiled = ", ".join(f"{k} {mib(n)}" for k, n in sorted(r.collectives.items()))
            print(
                f"| {seq} | {layout} | {mib(temps)} | {temps / base:.2f} | {mib(r.memory['peak'])} | {kv} "
                f"| {compiled} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
