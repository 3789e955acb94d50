"""Transformer LM training: meshfit against a hand-written `jax.jit` loop, tokens/s and MFU, per dtype policy.

The model is `examples/transformer_lm.py`'s decoder-only transformer on one
device. For each policy (`--policies`, default float32 and mixed_bfloat16):
  * raw:     a hand-written loop: `jax.jit` of loss, gradients and the optax
             update, state donated, the same policy written out (every layer's
             `dtype` the compute dtype, float32 master weights cast to it inside
             the step, logits back to float32 for the loss), batches already on
             the device;
  * meshfit: `model.fit` with `compile(dtype_policy=...)` on the same arrays;
  * meshfit_acc4: `gradient_accumulation_steps=4` at a quarter of the batch
             (the same rows per update), to show what accumulation costs;
  * meshfit_quarter: a quarter of the batch without accumulation (4 updates of
             B/4 rows for each of B rows): what the smaller steps cost by
             themselves, so acc4 / quarter is the accumulation's own cost.
Runs alternate between contenders; the median of `--repeats` is kept. FLOPs per
step come from XLA's cost analysis of each compiled step; MFU is against the
device's dense bf16 peak (`meshfit.callbacks.throughput.PEAK_BF16_FLOPS`).

    python benchmarks/bench_transformer.py                      # small, for a CPU
    python benchmarks/bench_transformer.py --layers 8 --d-model 1024 --heads 16 --context 512 --batch 32 --steps 40
    python benchmarks/bench_transformer.py --preset 1b --scan-layers --position rope --attention cudnn \\
        --remat minimal --loss-chunk 512 --policies mixed_bfloat16 --contenders raw,meshfit --batch 8 --steps 10

The model flags are the example's (`--preset`, sizes, `--remat`, `--attention`, `--position`,
`--scan-layers`, `--loss-chunk`); both contenders build the module with the same options. MFU is printed
with FLOPs counted as MaxText counts them (`maxtext_flops_per_step`: causal attention at half the square),
beside XLA's cost analysis of the compiled step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import smoke
from flax import nnx

import meshfit as mf
from meshfit.callbacks.throughput import peak_flops
from meshfit.core import precision
from meshfit.cost.step_report import jaxpr_flops

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from transformer_lm import (  # noqa: E402
    ChunkedLossModel,
    TransformerLM,
    add_model_arguments,
    chunked_cross_entropy,
    module_options,
    resolve_sizes,
)

CONTENDERS = ("raw", "meshfit", "meshfit_acc4", "meshfit_quarter")


def make_module(args):
    return TransformerLM(**module_options(args), rngs=nnx.Rngs(0))


def make_data(args):
    rng = np.random.default_rng(0)
    n = args.batch * args.steps
    x = rng.integers(0, args.vocab, (n, args.context), dtype=np.int32)
    return x, np.roll(x, -1, axis=1)


def maxtext_flops_per_step(args) -> float:
    """Training FLOPs of one update as MaxText's calculate_tflops_training_per_device counts them.

    3 x (forward FLOPs of the weight matmuls: q, k, v, out and the MLP per layer, plus the output
    projection) + 3 x causal attention (4 * B * T^2 * d per layer halved for the causal mask):
    6 * N_matmul * tokens + 6 * L * B * T^2 * d. Embedding lookups, norms and biases are not counted.
    """
    d, layers, tokens = args.d_model, args.layers, args.batch * args.context
    matmul_params = layers * (4 * d * d + 2 * d * 4 * d) + d * args.vocab
    causal_attention = layers * 4 * args.batch * args.context**2 * d / 2
    return 6 * matmul_params * tokens + 3 * causal_attention


def peak_bytes(device) -> int | None:
    """The device's peak bytes in use so far in this process (None where JAX does not report it: the CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("peak_bytes_in_use")


def optimizer():
    return mf.optimizers.get("adam", learning_rate=3e-4)


def raw_runner(args, policy_name, x, y):
    """The hand-written loop; returns (run all steps and block, FLOPs per step, bytes of temporaries)."""
    policy = precision.get(policy_name)
    module = make_module(args)
    if policy.name != "float32":  # as a Flax user writes it: every layer computes in the compute dtype
        for _, layer in nnx.iter_modules(module):
            if hasattr(layer, "dtype"):
                layer.dtype = policy.compute_dtype
    graphdef, params = nnx.split(module)
    params = nnx.to_pure_dict(params)
    tx = optimizer()

    def loss_fn(params, xb, yb):
        if policy.name != "float32":
            params = policy.cast_to_compute(params)
        out = nnx.merge(graphdef, params)(xb)
        if args.loss_chunk:  # the same chunked projection and cross-entropy as ChunkedLossModel
            return chunked_cross_entropy(out["hidden"], out["head"], yb, args.loss_chunk).mean()
        return optax.softmax_cross_entropy_with_integer_labels(out.astype(jnp.float32), yb).mean()

    def step(state, xb, yb):
        params, opt_state, loss_sum = state
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_sum + loss

    device = jax.devices()[0]
    state = jax.device_put((params, tx.init(params), jnp.zeros((), jnp.float32)), device)
    batches = [
        jax.device_put((x[i : i + args.batch], y[i : i + args.batch]), device) for i in range(0, len(x), args.batch)
    ]
    run = jax.jit(step, donate_argnums=0)
    lowered = run.lower(state, *batches[0])
    compiled = lowered.compile()
    cost = lowered.cost_analysis()  # as `step_report` counts: the compiled GPU program hides its GEMMs' FLOPs
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if not cost:  # no cost analysis of a lowered program on this backend (the CUDA plugin)
        cost = {"flops": jaxpr_flops(jax.make_jaxpr(step)(state, *batches[0]))}

    def go():
        nonlocal state
        for xb, yb in batches:
            state = run(state, xb, yb)
        jax.block_until_ready(state)

    return go, float(cost["flops"]), int(compiled.memory_analysis().temp_size_in_bytes)


def meshfit_runner(args, policy_name, x, y, accumulate=1, split=None):
    if args.loss_chunk:
        compute_dtype = precision.get(policy_name).compute_dtype
        model = ChunkedLossModel(lambda: make_module(args), chunk=args.loss_chunk, compute_dtype=compute_dtype)
        loss = None  # its compute_loss is the chunked cross-entropy
    else:  # from a factory: the parameters are created once, where the model keeps them
        model, loss = mf.Model(lambda: make_module(args)), mf.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=optimizer(),
        loss=loss,
        dtype_policy=policy_name,
        gradient_accumulation_steps=accumulate,
    )
    split = split or accumulate
    batch = args.batch // split
    model.fit(x[: 2 * args.batch], y[: 2 * args.batch], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    report = model.step_report()

    def go():
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        jax.block_until_ready(model.params)

    return go, report.flops * split, report.memory["temporaries"]


def make_contenders(args, policy, x, y) -> dict:
    makers = {
        "raw": lambda: raw_runner(args, policy, x, y),
        "meshfit": lambda: meshfit_runner(args, policy, x, y),
        "meshfit_acc4": lambda: meshfit_runner(args, policy, x, y, accumulate=4),
        "meshfit_quarter": lambda: meshfit_runner(args, policy, x, y, split=4),
    }
    return {name: makers[name]() for name in args.contenders}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)  # --preset, sizes, --remat, --attention, --position, --scan-layers, --loss-chunk
    parser.add_argument("--batch", type=int, default=16, help="rows per update (a multiple of 4)")
    parser.add_argument("--steps", type=int, default=20, help="updates per timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policies", default="float32,mixed_bfloat16")
    parser.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help=f"comma-separated, of {','.join(CONTENDERS)} (each holds its own parameters and Adam state)",
    )
    args = resolve_sizes(
        smoke.parse_args(
            parser,
            argv,
            layers=1,
            d_model=32,
            heads=2,
            context=16,
            batch=4,
            steps=2,
            repeats=1,
            policies="float32",
            contenders="raw,meshfit",
        )
    )
    args.contenders = args.contenders.split(",")
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    if unknown:
        parser.error(f"--contenders takes names of {CONTENDERS}. Received: {unknown}.")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = jax.devices()[0]
    peak = peak_flops(device.device_kind)
    x, y = make_data(args)
    abstract = nnx.eval_shape(lambda: make_module(args))  # counted without allocating a large model
    params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    tokens = args.batch * args.context
    model_flops = maxtext_flops_per_step(args)
    print(
        f"jax {jax.__version__} on {device.device_kind} ({device.platform}); transformer {args.layers} layers, "
        f"d_model {args.d_model}, {args.heads} heads, context {args.context}, vocab {args.vocab}: "
        f"{params / 1e6:.1f} M parameters; remat {args.remat or 'none'}, attention {args.attention}, "
        f"position {args.position}, scan_layers {args.scan_layers}, loss_chunk {args.loss_chunk or 'none'}; "
        f"batch {args.batch} ({tokens} tokens), {args.steps} updates a run, median of {args.repeats}; "
        f"peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s (dense bf16)\n"
        f"model FLOPs (MaxText convention: 6 x matmul params x tokens + causal attention 6 x L x B x T^2 x d): "
        f"{model_flops / 1e12:.3f} TFLOP/update; 'XLA' FLOPs: XLA's cost analysis of the compiled step"
    )
    for policy in args.policies.split(","):
        contenders = make_contenders(args, policy, x, y)
        for go, _, _ in contenders.values():
            go()  # warm-up: compilation and first transfers
        times = {k: [] for k in contenders}
        for _ in range(args.repeats):
            for name, (go, _, _) in contenders.items():
                t0 = time.perf_counter()
                go()
                times[name].append(time.perf_counter() - t0)
        print(f"\n{policy}:")
        rate = {}
        for name, (_, flops, temp) in contenders.items():
            seconds = statistics.median(times[name]) / args.steps
            rate[name] = tokens / seconds
            mfu = f"{model_flops / seconds / peak:6.1%}" if peak else "   n/a"
            xla_mfu = f"{flops / seconds / peak:6.1%}" if peak else "   n/a"
            print(
                f"  {name:15s} {seconds * 1e3:8.2f} ms/update  {rate[name]:11,.0f} tokens/s  "
                f"MFU {mfu} (MaxText FLOPs; XLA {flops / 1e12:7.3f} TFLOP/update, {xla_mfu})  "
                f"temporaries {temp / 2**20:8.1f} MiB"
            )
        if "raw" in rate and "meshfit" in rate:
            print(f"  ratio meshfit/raw = {rate['meshfit'] / rate['raw']:.3f}  (target >= 0.98)")
        if {"meshfit", "meshfit_acc4", "meshfit_quarter"} <= set(rate):
            acc, quarter = rate["meshfit"] / rate["meshfit_acc4"], rate["meshfit_quarter"] / rate["meshfit_acc4"]
            print(f"  accumulation K=4 / K=1 time = {acc:.3f}  (target <= 1.05); K=4 / quarter batches = {quarter:.3f}")
        del contenders
    memory = peak_bytes(device)
    if memory is not None:
        print(f"\npeak device memory in this process (all contenders): {memory / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
