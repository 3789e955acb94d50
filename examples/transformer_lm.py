"""Train a small byte-level transformer language model on Python's own standard library.

A decoder-only transformer in `flax.nnx` (token + learned position embeddings,
pre-LayerNorm blocks of causal multi-head self-attention and an MLP, a final
LayerNorm and a tied or untied output head) learns to predict the next byte of
the source of a few standard-library modules (argparse.py, difflib.py,
textwrap.py, ...: text that ships with every Python). It trains with
`model.fit` under a `MeshStrategy` over a `data` x `fsdp` x `tensor` mesh:

  * the batch is split over ("data", "fsdp");
  * Megatron-style tensor parallelism, written as regex rules on parameter
    paths: the attention query/key/value kernels are column-parallel (heads
    split over "tensor"), the attention output kernel row-parallel, the MLP
    up-projection column-parallel and the down-projection row-parallel; the
    other dimension of each of these kernels, and the embeddings, are sharded
    over "fsdp" (ZeRO-3 style, gathered when used);
  * `mf.strategies.constrain` pins the activations between and inside blocks.

`model.summary()` prints every parameter's PartitionSpec and bytes per device.
After training, text is sampled from a prompt with the trained module.

    python examples/transformer_lm.py                    # 8 simulated CPU devices, mesh 1,4,2
    python examples/transformer_lm.py --mesh 2,2,2 --epochs 8
    python examples/transformer_lm.py --layers 4 --d-model 256 --heads 8 --context 128
    python examples/transformer_lm.py --host-devices 0   # leave XLA_FLAGS alone (real devices)
    python examples/transformer_lm.py --remat            # rematerialised blocks: temporaries with and without
    python examples/transformer_lm.py --mesh 1,8,1 --layers 12 --d-model 1024 --heads 16 --context 256 --report-only
    python examples/transformer_lm.py --backup-dir /tmp/lm_backup  # kill it, run it again: it resumes, with a ledger

The model is built from a factory (`mf.Model(lambda: TransformerLM(...))`):
its parameters are created straight into their sharded layout, so a model
larger than one device can be built at all (`--eager` creates it whole first).
`--report-only` prints what one step needs per device (`model.step_report`)
without training: the last command shows a 152 M-parameter model, 1.8 GB with
Adam's moments, of which each of the 8 devices holds an eighth.

On CPU, when XLA_FLAGS is not set, the script sets
`XLA_FLAGS=--xla_force_host_platform_device_count=8` before importing JAX, so the
8-device mesh runs on any machine (`--host-devices N` picks another count, 0
turns this off). This happens only when the file is run as a script; importing
it and calling `main()` uses whatever devices JAX already has. The default
configuration trains in one to three minutes on a 2-core CPU.
"""

from __future__ import annotations

import os
import sys

DEFAULT_HOST_DEVICES = 8


def _force_host_devices(argv) -> None:
    """Simulates `--host-devices` CPU devices (default 8) unless XLA_FLAGS is set or JAX is not on CPU.

    Must run before JAX is imported; it reads its flag straight from argv.
    """
    count = DEFAULT_HOST_DEVICES
    for i, arg in enumerate(argv):
        if arg == "--host-devices" and i + 1 < len(argv):
            count = int(argv[i + 1])
        elif arg.startswith("--host-devices="):
            count = int(arg.split("=", 1)[1])
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    on_cpu = platforms in ("", "cpu") or platforms.startswith("cpu")  # flag only affects the host platform
    if count > 0 and on_cpu and "XLA_FLAGS" not in os.environ and "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}"


if __name__ == "__main__":
    _force_host_devices(sys.argv[1:])

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import meshfit as mf  # noqa: E402
from meshfit.summary import bytes_per_device  # noqa: E402

BATCH = ("data", "fsdp")  # mesh axes the batch dimension is split over
VOCAB = 256  # bytes

# A fixed, sorted list of standard-library modules: ~440 KB of Python source.
# Modules missing from some Python version are skipped; `--max-bytes` truncates.
CORPUS_MODULES = (
    "argparse.py",
    "dataclasses.py",
    "difflib.py",
    "functools.py",
    "heapq.py",
    "pathlib.py",
    "shutil.py",
    "string.py",
    "textwrap.py",
)


# -- data ----------------------------------------------------------------------------------------


def load_corpus(max_bytes: int) -> bytes:
    """The concatenated source of CORPUS_MODULES, at most `max_bytes` long."""
    stdlib = os.path.dirname(os.__file__)
    parts = []
    for name in CORPUS_MODULES:
        for path in (os.path.join(stdlib, name), os.path.join(stdlib, name[:-3], "__init__.py")):
            if os.path.exists(path):
                with open(path, "rb") as f:
                    parts.append(f.read())
                break
    text = b"\n\n".join(parts)[:max_bytes]
    if len(text) < 10_000:
        raise SystemExit(f"Found only {len(text)} bytes of standard-library source in {stdlib}.")
    return text


def windows(data: np.ndarray, context: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) next-byte pairs: x = data[i:i+context], y = data[i+1:i+context+1] for i = 0, stride, ..."""
    starts = np.arange(0, len(data) - context - 1, stride)
    index = starts[:, None] + np.arange(context)[None, :]
    return data[index].astype(np.int32), data[index + 1].astype(np.int32)


def make_datasets(text: bytes, context: int, val_fraction: float = 0.1):
    """Train windows overlap by half a context; validation windows (the last 10% of the text) do not."""
    data = np.frombuffer(text, np.uint8)
    split = int(len(data) * (1 - val_fraction))
    train = windows(data[:split], context, max(1, context // 2))
    val = windows(data[split:], context, context)
    return train, val


# -- model ---------------------------------------------------------------------------------------


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention; kernels keep heads as their own axis so rules can split them."""

    def __init__(self, d_model: int, heads: int, *, rngs: nnx.Rngs):
        if d_model % heads:
            raise ValueError(f"--d-model {d_model} must be divisible by --heads {heads}.")
        head_dim = d_model // heads
        self.query = nnx.LinearGeneral(d_model, (heads, head_dim), rngs=rngs)  # (d, heads, head_dim)
        self.key = nnx.LinearGeneral(d_model, (heads, head_dim), rngs=rngs)
        self.value = nnx.LinearGeneral(d_model, (heads, head_dim), rngs=rngs)
        self.out = nnx.LinearGeneral((heads, head_dim), d_model, axis=(-2, -1), rngs=rngs)  # (heads, head_dim, d)

    def __call__(self, x):
        heads = (BATCH, None, "tensor", None)  # (batch, time, heads, head_dim): heads split over "tensor"
        q = mf.strategies.constrain(self.query(x), *heads)
        k = mf.strategies.constrain(self.key(x), *heads)
        v = mf.strategies.constrain(self.value(x), *heads)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        y = mf.strategies.constrain(y, *heads)
        return self.out(y)  # row-parallel: partial sums over "tensor" are reduced here


class MLP(nnx.Module):
    def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(d_model, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d_model, rngs=rngs)

    def __call__(self, x):
        h = mf.strategies.constrain(nnx.gelu(self.up(x)), BATCH, None, "tensor")
        return self.down(h)


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, heads: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attn = CausalSelfAttention(d_model, heads, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.mlp = MLP(d_model, 4 * d_model, rngs=rngs)

    def __call__(self, x):
        x = mf.strategies.constrain(x + self.attn(self.ln1(x)), BATCH, None, None)
        return mf.strategies.constrain(x + self.mlp(self.ln2(x)), BATCH, None, None)


class TransformerLM(nnx.Module):
    """Decoder-only transformer: (batch, time) int tokens -> (batch, time, vocab) logits."""

    def __init__(
        self,
        *,
        vocab: int = VOCAB,
        context: int = 64,
        layers: int = 2,
        d_model: int = 128,
        heads: int = 4,
        tied: bool = True,
        remat: bool = False,
        rngs: nnx.Rngs,
    ):
        self.context = context
        self.tied = tied
        self.remat = remat
        embed_init = nnx.initializers.normal(0.02)
        self.tok_embed = nnx.Embed(vocab, d_model, embedding_init=embed_init, rngs=rngs)
        self.pos_embed = nnx.Embed(context, d_model, embedding_init=embed_init, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, heads, rngs=rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.lm_head = None if tied else nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        positions = jnp.arange(tokens.shape[1])
        x = self.tok_embed(tokens) + self.pos_embed(positions)[None]
        x = mf.strategies.constrain(x, BATCH, None, None)
        for block in self.blocks:
            # Rematerialised: the backward pass recomputes the block's activations
            # instead of keeping them from the forward pass.
            x = nnx.remat(_call_block)(block, x) if self.remat else block(x)
        x = self.ln_f(x)
        return self.tok_embed.attend(x) if self.tied else self.lm_head(x)


def _call_block(block: Block, x):
    return block(x)


def sharding_rules(tied: bool) -> list[tuple[str, tuple]]:
    """Megatron tensor parallelism over "tensor", the other kernel dimension and embeddings over "fsdp".

    Regexes are searched in parameter paths such as 'blocks/0/attn/query/kernel'
    (see the summary). Unmatched parameters (LayerNorms, small biases) fall to
    the default rule, which replicates arrays under 4096 elements.
    """
    # Trailing dimensions left out of a spec are replicated. (Writing them as a
    # trailing None is equivalent, but JAX returns the step's outputs with the
    # Nones dropped, so the train step would compile a second time.)
    rules = [
        (r"attn/(query|key|value)/kernel", ("fsdp", "tensor")),  # (d, heads, hd): column-parallel
        (r"attn/(query|key|value)/bias", ("tensor",)),  # (heads, hd)
        (r"attn/out/kernel", ("tensor", None, "fsdp")),  # (heads, hd, d): row-parallel
        (r"mlp/up/kernel", ("fsdp", "tensor")),  # (d, 4d): column-parallel
        (r"mlp/up/bias", ("tensor",)),
        (r"mlp/down/kernel", ("tensor", "fsdp")),  # (4d, d): row-parallel
        (r"(tok|pos)_embed/embedding", ("fsdp",)),  # (vocab | context, d)
    ]
    if not tied:
        rules.append((r"lm_head/kernel", ("fsdp", "tensor")))  # (d, vocab): vocab-parallel logits
    return rules


def plan_factory(remat: bool = False) -> TransformerLM:
    """The default model, for `meshfit plan examples/transformer_lm.py:plan_factory` (see docs/performance.md)."""
    return TransformerLM(remat=remat, rngs=nnx.Rngs(0))


#: The default model's rules, for `meshfit plan ... --rules examples/transformer_lm.py:PLAN_RULES`.
PLAN_RULES = sharding_rules(tied=True)


# -- sampling --------------------------------------------------------------------------------------


def sample(module: TransformerLM, prompt: str, length: int, temperature: float = 0.8, seed: int = 0) -> str:
    """Generates `length` bytes after `prompt` with the module directly (greedy when temperature is 0).

    The model always sees a fixed (1, context) window (prompt left-aligned, or
    the last `context` bytes), so the forward pass compiles once; causal
    attention makes the padding to the right of the last byte irrelevant.
    """
    context = module.context
    graphdef, state = nnx.split(module)

    @jax.jit
    def next_logits(state, window, last):
        logits = nnx.merge(graphdef, state)(window)
        return logits[0, last]

    tokens = list(prompt.encode("utf-8")) or [ord("\n")]
    rng = np.random.default_rng(seed)
    for _ in range(length):
        recent = tokens[-context:]
        window = np.zeros((1, context), np.int32)
        window[0, : len(recent)] = recent
        logits = np.asarray(next_logits(state, window, len(recent) - 1), np.float64)
        if temperature <= 0:
            token = int(np.argmax(logits))
        else:
            p = np.exp((logits - logits.max()) / temperature)
            token = int(rng.choice(VOCAB, p=p / p.sum()))
        tokens.append(token)
    return bytes(tokens).decode("utf-8", errors="replace")


# -- main ------------------------------------------------------------------------------------------


def print_memory(model, report, without_remat=None) -> None:
    """The state's total bytes against one device's share, and what a step needs per device."""
    state_bytes = sum(a.nbytes for a in jax.tree.leaves(model.session.state))
    per_device = sum(bytes_per_device(a) for a in jax.tree.leaves(model.session.state))
    mem = report.memory
    print(
        f"state (parameters + Adam): {state_bytes / 2**20:,.1f} MiB in all, {per_device / 2**20:,.1f} MiB on device 0 "
        f"({state_bytes / max(per_device, 1):.1f}x less); train step per device: peak {mem['peak'] / 2**20:,.1f} MiB, "
        f"temporaries {mem['temporaries'] / 2**20:,.1f} MiB"
    )
    if without_remat is not None:
        print(
            f"  temporaries per device with --remat {mem['temporaries'] / 2**20:,.1f} MiB, without "
            f"{without_remat.memory['temporaries'] / 2**20:,.1f} MiB"
        )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mesh",
        default=None,
        help='data,fsdp,tensor sizes; one may be -1 (default "1,4,2" on 8 devices, else "-1,1,1")',
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64, help="bytes per training window")
    parser.add_argument(
        "--untied-head", action="store_true", help="a separate output projection instead of reusing the token embedding"
    )
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size (windows)")
    parser.add_argument("--steps-per-epoch", type=int, default=100)
    parser.add_argument("--validation-steps", type=int, default=10)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--max-bytes", type=int, default=400_000, help="bytes of source text to use")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--sample-len", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 samples greedily")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", type=int, default=2)
    parser.add_argument(
        "--eager",
        action="store_true",
        help="create the module eagerly and then shard it (default: from a factory, straight into the layout)",
    )
    parser.add_argument(
        "--remat", action="store_true", help="rematerialise each block (nnx.remat): less activation memory"
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="build the model and print what a step needs per device (step_report), without training",
    )
    parser.add_argument(
        "--backup-dir",
        default=None,
        help="back up every --backup-freq steps (BackupAndRestore) and keep a Goodput ledger, printed at the end: "
        "a killed or preempted run started again resumes, and its ledger covers every process; JAX's persistent "
        "compilation cache lives there too, so the resumed run does not compile again",
    )
    parser.add_argument("--backup-freq", type=int, default=25, help="steps between backups")
    parser.add_argument(
        "--no-compilation-cache", action="store_true", help="with --backup-dir: compile from scratch on a resume"
    )
    parser.add_argument(
        "--host-devices",
        type=int,
        default=DEFAULT_HOST_DEVICES,
        help="simulated CPU devices when run as a script without XLA_FLAGS (0: off)",
    )
    return parser.parse_args(argv)


def parse_mesh(text: str | None) -> dict[str, int]:
    if text is None:
        text = "1,4,2" if len(jax.devices()) == 8 else "-1,1,1"
    sizes = [int(s) for s in text.split(",")]
    if len(sizes) != 3:
        raise SystemExit(f"--mesh takes three sizes data,fsdp,tensor. Received: {text!r}.")
    return dict(zip(("data", "fsdp", "tensor"), sizes, strict=True))


def main(argv=None, callbacks=()) -> dict:
    """Trains and samples; returns {"history", "val_loss", "sample", "model", "seconds"}.

    `callbacks` are added to `fit`'s (benchmarks/bench_restart.py times a resumed run with one).
    """
    args = parse_args(argv)
    start = time.perf_counter()
    if args.backup_dir and not args.no_compilation_cache:
        # From the start, so what compiles before fit (step_report, the sampler) is cached too;
        # BackupAndRestore alone turns the cache on when fit begins.
        mf.compilation_cache.use(os.path.join(args.backup_dir, mf.compilation_cache.BACKUP_CACHE_NAME))
    text = load_corpus(args.max_bytes)
    (x_train, y_train), (x_val, y_val) = make_datasets(text, args.context)
    tied = not args.untied_head

    strategy = mf.strategies.MeshStrategy(axes=parse_mesh(args.mesh), rules=sharding_rules(tied))
    chief = strategy.is_chief
    if chief:
        print(
            f"{len(text):,} bytes of stdlib source -> {len(x_train):,} train / {len(x_val):,} validation "
            f"windows of {args.context} bytes; {jax.device_count()} devices ({jax.devices()[0].platform})"
        )

    def factory(remat=args.remat):
        return TransformerLM(
            context=args.context,
            layers=args.layers,
            d_model=args.d_model,
            heads=args.heads,
            tied=tied,
            remat=remat,
            rngs=nnx.Rngs(args.seed),
        )

    def build(remat=args.remat):
        with strategy.scope():
            # From a factory, the parameters are created in their sharded layout: no device ever
            # holds a whole one. An eager module is created whole, then sharded.
            model = mf.Model(factory(remat) if args.eager else lambda: factory(remat), seed=args.seed)
            model.compile(
                optimizer=mf.optimizers.get("adam", learning_rate=args.learning_rate),
                loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=args.steps_per_execution,
            )
        return model

    model = build()
    batch = (x_train[: args.batch_size], y_train[: args.batch_size])
    report = model.step_report(*batch)  # compiled for one batch, nothing run
    without_remat = build(remat=False).step_report(*batch) if args.remat else None
    if chief:
        model.summary()
        print_memory(model, report, without_remat)
    if args.report_only:
        return {"model": model, "report": report, "report_without_remat": without_remat}
    callbacks = list(callbacks)
    if args.backup_dir:
        goodput = mf.callbacks.Goodput(record_every=1.0)  # a record a second: a kill loses at most that to "down"
        backup = mf.callbacks.BackupAndRestore(
            args.backup_dir, save_freq=args.backup_freq, compilation_cache=not args.no_compilation_cache
        )
        callbacks += [goodput, backup]
    history = model.fit(
        x_train,
        y_train,
        callbacks=callbacks,
        batch_size=args.batch_size,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        validation_data=(x_val, y_val),
        validation_steps=args.validation_steps,
        verbose=args.verbose,
    )
    if args.backup_dir and chief:
        print(goodput.ledger)
    losses = history.history["loss"]
    val_losses = history.history["val_loss"]
    text_out = sample(model.module, args.prompt, args.sample_len, args.temperature, args.seed)
    elapsed = time.perf_counter() - start
    if chief:
        print(
            f"train loss {losses[0]:.3f} -> {losses[-1]:.3f}, validation loss {val_losses[0]:.3f} -> "
            f"{val_losses[-1]:.3f} nats/byte ({elapsed:.1f} s, {strategy!r})"
        )
        print(f"--- sample (prompt {args.prompt!r}, temperature {args.temperature}) ---")
        print(text_out)
    return {
        "history": history.history,
        "val_loss": val_losses[-1],
        "sample": text_out,
        "model": model,
        "seconds": elapsed,
    }


if __name__ == "__main__":
    main()
