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
    python examples/transformer_lm.py --preset tiny --scan-layers --position rope --remat minimal --loss-chunk 8
    python examples/transformer_lm.py --layers 4 --pipeline 4 --microbatches 8 --schedule 1f1b

The last line turns on the fast-decoder options (docs/performance.md, "Fast decoder options"): a
scanned layer stack, rotary positions, a named remat policy and chunked cross-entropy, with
`--attention auto` (the default) taking cuDNN flash attention where it can run; `--preset 350m|1b|2b`
and `--vocab` other than 256 train on synthetic tokens.

`--pipeline P` builds the decoder's blocks on `meshfit.pipeline.Stages` and trains on a
`MeshStrategy(axes={"stage": P, "data": devices / P}, pipeline=Pipeline(microbatches=M,
schedule=...))`: each stage's devices hold `layers / P` blocks, the batch flows through them in M
microbatches per data replica (`--microbatches`, default P; `--schedule gpipe|circular|1f1b`,
`--repeats` for circular), the embeddings and head run outside the pipeline; the step report
prints the bubble, the point-to-point bytes and a stage's memory (docs/sharding.md, "Pipeline
parallelism"). `--layers` must divide by P (times `--repeats`). `--mesh context=C` beside it splits
each microbatch's sequence over C devices too (`--context-parallel ring|all_gather`).

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
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402

import meshfit as mf  # noqa: E402
from meshfit.cost.summary import bytes_per_device  # noqa: E402
from meshfit.pipeline import Stages  # noqa: E402

BATCH = ("data", "fsdp")  # mesh axes the batch dimension is split over
SEQ = "context"  # the mesh axis the time dimension is split over (dropped from a pin on a mesh without it)
CONTEXT_PARALLEL_CHOICES = ("ring", "all_gather", "none")
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


def synthetic_tokens(samples: int, context: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) windows of a learnable token task over `vocab` tokens, for vocabularies beyond bytes.

    Each sequence follows a fixed random permutation of the vocabulary (token t + 1 = perm[token t])
    from a random start, with one token in eight replaced by a random one.
    """
    rng = np.random.default_rng(seed)
    perm = rng.permutation(vocab).astype(np.int32)
    seq = np.empty((samples, context + 1), np.int32)
    seq[:, 0] = rng.integers(0, vocab, samples)
    noise = rng.random((samples, context)) < 0.125
    random_tokens = rng.integers(0, vocab, (samples, context), dtype=np.int32)
    for i in range(context):
        seq[:, i + 1] = np.where(noise[:, i], random_tokens[:, i], perm[seq[:, i]])
    return seq[:, :-1], seq[:, 1:]


# -- model ---------------------------------------------------------------------------------------

ATTENTION_CHOICES = ("auto", "xla", "cudnn")
POSITION_CHOICES = ("learned", "rope")
# What the "minimal" remat policies keep from the forward pass: the projections' outputs, named with
# `checkpoint_name` where they are computed (as MaxText names its checkpoints).
PROJECTIONS = ("query_proj", "key_proj", "value_proj", "out_proj", "mlp_up", "mlp_down")
REMAT_POLICIES = {
    "full": None,  # jax.checkpoint's default: nothing saved (what remat=True has always meant)
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(*PROJECTIONS),
    "minimal_with_context": jax.checkpoint_policies.save_only_these_names(*PROJECTIONS, "context"),
}


def remat_policy_name(remat) -> str | None:
    """The name in REMAT_POLICIES that `remat` asks for, or None for no rematerialisation.

    False/None/"none" -> None; True -> "full" (each block recomputed whole in the backward pass).
    """
    if remat is None or remat is False or remat == "none":
        return None
    if remat is True:
        return "full"
    if remat in REMAT_POLICIES:
        return remat
    raise ValueError(f"`remat` must be a bool, 'none' or one of {sorted(REMAT_POLICIES)}. Received: remat={remat!r}.")


def cudnn_flash_blocker(dtype, head_dim: int) -> str | None:
    """Why cuDNN flash attention cannot run here (None when it can): a CUDA GPU, bf16/fp16, head_dim % 8 == 0 <= 128."""
    device = jax.devices()[0]
    version = getattr(getattr(device, "client", None), "platform_version", "") or ""
    if device.platform != "gpu" or "cuda" not in version.lower():
        return f"the platform is {device.platform!r} ({device.device_kind}), not a CUDA GPU"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the attention computes in {jnp.dtype(dtype).name}, not bfloat16 or float16"
    if head_dim % 8 or head_dim > 128:
        return f"head_dim is {head_dim}, not a multiple of 8 at most 128"
    return None


def attention_implementation(choice: str, dtype, head_dim: int) -> str:
    """The `implementation=` for jax.nn.dot_product_attention: "auto" picks cuDNN where it can run, else XLA."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"`attention` must be one of {ATTENTION_CHOICES}. Received: attention={choice!r}.")
    if choice == "xla":
        return "xla"
    blocker = cudnn_flash_blocker(dtype, head_dim)
    if choice == "cudnn" and blocker:
        raise ValueError(
            "attention='cudnn' needs cuDNN flash attention: a CUDA GPU and bfloat16/float16 "
            f"(e.g. dtype_policy='mixed_bfloat16'). Received: {blocker}. Use attention='auto' or 'xla'."
        )
    return "xla" if blocker else "cudnn"


def rotary(x, positions, base: float = 10_000.0):
    """Rotary position embedding of x (batch, time, heads, head_dim) at integer `positions` (time,).

    Pairs (i, i + head_dim/2) rotate by the angle position * base**(-2i/head_dim), so a query-key
    product depends on their positions only through their difference.
    """
    half = x.shape[-1] // 2
    if x.shape[-1] % 2:
        raise ValueError(f"position='rope' needs an even head dimension. Received: head_dim={x.shape[-1]}.")
    inverse_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, None] * inverse_freq[None, :]  # (time, half)
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention; kernels keep heads as their own axis so rules can split them."""

    def __init__(
        self,
        d_model: int,
        heads: int,
        *,
        attention: str = "auto",
        rope: bool = False,
        context_parallel: str = "ring",
        rngs: nnx.Rngs,
    ):
        if d_model % heads:
            raise ValueError(f"--d-model {d_model} must be divisible by --heads {heads}.")
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"`attention` must be one of {ATTENTION_CHOICES}. Received: attention={attention!r}.")
        head_dim = d_model // heads
        self.attention = attention
        self.context_parallel = context_parallel
        self.rope = rope
        self.query = nnx.LinearGeneral(d_model, (heads, head_dim), rngs=rngs)  # (d, heads, head_dim)
        self.key = nnx.LinearGeneral(d_model, (heads, head_dim), rngs=rngs)
        self.value = nnx.LinearGeneral(d_model, (heads, head_dim), rngs=rngs)
        self.out = nnx.LinearGeneral((heads, head_dim), d_model, axis=(-2, -1), rngs=rngs)  # (heads, head_dim, d)

    def __call__(self, x):
        heads = (BATCH, SEQ, "tensor", None)  # (batch, time, heads, head_dim): heads split over "tensor"
        q = mf.strategies.constrain(checkpoint_name(self.query(x), "query_proj"), *heads)
        k = mf.strategies.constrain(checkpoint_name(self.key(x), "key_proj"), *heads)
        v = mf.strategies.constrain(checkpoint_name(self.value(x), "value_proj"), *heads)
        if self.rope:
            positions = jnp.arange(x.shape[1])
            q, k = rotary(q, positions), rotary(k, positions)
        implementation = attention_implementation(self.attention, q.dtype, q.shape[-1])
        cp = None if self.context_parallel == "none" else self.context_parallel  # used only under a context axis
        y = mf.layers.dot_product_attention(q, k, v, causal=True, context_parallel=cp, implementation=implementation)
        y = mf.strategies.constrain(checkpoint_name(y, "context"), *heads)
        return checkpoint_name(self.out(y), "out_proj")  # row-parallel: partial sums over "tensor" reduced here


class MLP(nnx.Module):
    def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(d_model, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d_model, rngs=rngs)

    def __call__(self, x):
        h = mf.strategies.constrain(nnx.gelu(checkpoint_name(self.up(x), "mlp_up")), BATCH, SEQ, "tensor")
        return checkpoint_name(self.down(h), "mlp_down")


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)).

    `pin`: constrain its outputs to the batch axes (off inside a pipeline, whose stage loop lays out
    what it passes between stages itself).
    """

    def __init__(
        self,
        d_model: int,
        heads: int,
        *,
        attention: str = "auto",
        rope: bool = False,
        pin: bool = True,
        context_parallel: str = "ring",
        rngs: nnx.Rngs,
    ):
        self.pin = pin
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attn = CausalSelfAttention(
            d_model, heads, attention=attention, rope=rope, context_parallel=context_parallel, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.mlp = MLP(d_model, 4 * d_model, rngs=rngs)

    def __call__(self, x):
        pin = (lambda h: mf.strategies.constrain(h, BATCH, SEQ, None)) if self.pin else (lambda h: h)
        x = pin(x + self.attn(self.ln1(x)))
        return pin(x + self.mlp(self.ln2(x)))


class TransformerLM(nnx.Module):
    """Decoder-only transformer: (batch, time) int tokens -> (batch, time, vocab) logits.

    Args:
        remat: False (default), True (each block recomputed whole in the backward pass) or a policy
            name of REMAT_POLICIES ("nothing_saveable", "dots_saveable",
            "dots_with_no_batch_dims_saveable", "minimal": keep the projections' outputs).
        attention: "auto" (cuDNN flash attention where it can run, else XLA), "xla" or "cudnn".
        context_parallel: under a `context` mesh axis, how attention reaches the other devices' keys
            (`mf.layers.dot_product_attention`): "ring", "all_gather" or "none" (GSPMD's gathers).
        position: "learned" (a position embedding table) or "rope" (rotary, no parameters).
        scan_layers: stack the blocks' parameters on a leading layer axis and run them with
            `nnx.scan`: one block is traced and compiled, whatever the depth.
        stages: build the blocks on `meshfit.pipeline.Stages` (stacked, run in one scan without a
            `stage` mesh axis and pipelined under one); no `remat` or `scan_layers` with it.
        output: "logits", or "hidden": {"hidden": final hidden states, "head": the (d_model, vocab)
            output kernel}, for a loss that projects in chunks (`chunked_cross_entropy`).
    """

    def __init__(
        self,
        *,
        vocab: int = VOCAB,
        context: int = 64,
        layers: int = 2,
        d_model: int = 128,
        heads: int = 4,
        tied: bool = True,
        remat: bool | str = False,
        attention: str = "auto",
        position: str = "learned",
        scan_layers: bool = False,
        output: str = "logits",
        stages: bool = False,
        context_parallel: str = "ring",
        rngs: nnx.Rngs,
    ):
        if position not in POSITION_CHOICES:
            raise ValueError(f"`position` must be one of {POSITION_CHOICES}. Received: position={position!r}.")
        if output not in ("logits", "hidden"):
            raise ValueError(f"`output` must be 'logits' or 'hidden'. Received: output={output!r}.")
        if stages and (remat or scan_layers):
            raise ValueError(
                "`stages` runs the blocks on meshfit.pipeline.Stages, without remat or scan_layers. "
                f"Received: remat={remat!r}, scan_layers={scan_layers!r}."
            )
        self.context = context
        self.tied = tied
        self.remat = remat
        self.remat_policy = remat_policy_name(remat)
        self.scan_layers = scan_layers
        self.stages = stages
        self.output = output
        embed_init = nnx.initializers.normal(0.02)
        self.tok_embed = nnx.Embed(vocab, d_model, embedding_init=embed_init, rngs=rngs)
        self.pos_embed = (
            nnx.Embed(context, d_model, embedding_init=embed_init, rngs=rngs) if position == "learned" else None
        )

        def make_block(rngs):
            return Block(
                d_model,
                heads,
                attention=attention,
                rope=position == "rope",
                pin=not stages,
                context_parallel=context_parallel,
                rngs=rngs,
            )

        self.blocks: Any
        if stages:
            self.blocks = Stages(make_block, layers, rngs=rngs)
        elif scan_layers:
            self.blocks = stacked_blocks(layers, make_block, rngs)
        else:
            self.blocks = nnx.List([make_block(rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
        self.lm_head = None if tied else nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        hidden = self.hidden(tokens)
        if self.output == "hidden":
            return {"hidden": hidden, "head": self.head_kernel()}
        return self.project(hidden)

    def logits(self, tokens):
        """(batch, time, vocab) logits, whatever `output` is (for sampling)."""
        return self.project(self.hidden(tokens))

    def hidden(self, tokens):
        """The final LayerNorm's output, (batch, time, d_model)."""
        x = self.tok_embed(tokens)
        if self.pos_embed is not None:
            x = x + self.pos_embed(jnp.arange(tokens.shape[1]))[None]
        x = mf.strategies.constrain(x, BATCH, SEQ, None)
        call = block_call(self.remat_policy)
        if self.stages:
            x = self.blocks(x)
        elif self.scan_layers:
            x = scan_blocks(call, self.blocks, x)
        else:
            for block in self.blocks:
                x = call(block, x)
        return self.ln_f(x)

    def head_kernel(self):
        """The output projection as a (d_model, vocab) kernel (the token embedding's transpose when tied)."""
        return self.tok_embed.embedding[...].T if self.tied else self.lm_head.kernel[...]

    def project(self, hidden):
        return self.tok_embed.attend(hidden) if self.tied else self.lm_head(hidden)


def stacked_blocks(layers: int, make_block, rngs: nnx.Rngs):
    """`layers` blocks as one Block whose parameters have a leading layer axis (nnx.vmap of the constructor)."""

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return make_block(rngs)

    return create(rngs)


def scan_blocks(call, blocks, x):
    """Runs stacked blocks over x with nnx.scan: the body (one block) is traced once."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
        return call(block, x)

    return forward(x, blocks)


def block_call(policy_name: str | None):
    """(block, x) -> block(x), rematerialised under the named policy (REMAT_POLICIES) unless None."""
    if policy_name is None:
        return _call_block
    return nnx.remat(_call_block, policy=REMAT_POLICIES[policy_name])


def _call_block(block: Block, x):
    return block(x)


def chunked_cross_entropy(hidden, head, targets, chunk: int, compute_dtype=None):
    """Per-token cross-entropy (batch, time) of logits = hidden @ head, `chunk` positions at a time.

    hidden (batch, time, d), head (d, vocab), integer targets (batch, time). Only one chunk's
    logits (batch, chunk, vocab) exist at once: a `lax.scan` over the chunks, each under
    `jax.checkpoint` so the backward pass recomputes a chunk's logits instead of keeping them.
    The projection runs in `compute_dtype` (default: hidden's), the softmax in float32.
    """
    batch, time, d = hidden.shape
    if chunk <= 0 or time % chunk:
        raise ValueError(
            f"The loss chunk must be a positive divisor of the sequence length {time}. Received: chunk={chunk}."
        )
    dtype = compute_dtype or hidden.dtype
    hidden, head = hidden.astype(dtype), head.astype(dtype)
    h = hidden.reshape(batch, time // chunk, chunk, d).swapaxes(0, 1)  # (chunks, batch, chunk, d)
    y = targets.reshape(batch, time // chunk, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def chunk_losses(h, y):
        logits = (h @ head).astype(jnp.float32)
        picked = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked

    _, losses = jax.lax.scan(lambda carry, xs: (carry, chunk_losses(*xs)), None, (h, y))
    return losses.swapaxes(0, 1).reshape(batch, time)


class ChunkedLossModel(mf.Model):
    """A model whose loss is `chunked_cross_entropy` of a TransformerLM(output="hidden"): no whole-batch logits.

    Args:
        chunk: sequence positions projected to the vocabulary at a time.
        compute_dtype: the projection's dtype (the policy's compute dtype: meshfit hands
            `compute_loss` the module's outputs in float32).
    """

    def __init__(self, module, *, chunk: int, compute_dtype=jnp.float32, **kwargs):
        super().__init__(module, **kwargs)
        self.chunk = chunk
        self.compute_dtype = compute_dtype

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        losses = chunked_cross_entropy(y_pred["hidden"], y_pred["head"], y, self.chunk, self.compute_dtype)
        if sample_weight is not None:
            losses = losses * jnp.reshape(
                sample_weight, sample_weight.shape + (1,) * (losses.ndim - sample_weight.ndim)
            )
        return jnp.mean(losses)  # Keras's "sum_over_batch_size": over every token


def sharding_rules(tied: bool, scan_layers: bool = False) -> list[tuple[str, tuple]]:
    """Megatron tensor parallelism over "tensor", the other kernel dimension and embeddings over "fsdp".

    Regexes are searched in parameter paths such as 'blocks/0/attn/query/kernel'
    (see the summary); with `scan_layers` the paths are 'blocks/attn/query/kernel'
    and the blocks' arrays have a leading layer axis, which every block rule
    leaves whole (None). Unmatched parameters (LayerNorms, small biases) fall to
    the default rule, which replicates arrays under 4096 elements.
    """
    # Trailing dimensions left out of a spec are replicated. (Writing them as a
    # trailing None is equivalent, but JAX returns the step's outputs with the
    # Nones dropped, so the train step would compile a second time.)
    block_rules = [
        (r"attn/(query|key|value)/kernel", ("fsdp", "tensor")),  # (d, heads, hd): column-parallel
        (r"attn/(query|key|value)/bias", ("tensor",)),  # (heads, hd)
        (r"attn/out/kernel", ("tensor", None, "fsdp")),  # (heads, hd, d): row-parallel
        (r"mlp/up/kernel", ("fsdp", "tensor")),  # (d, 4d): column-parallel
        (r"mlp/up/bias", ("tensor",)),
        (r"mlp/down/kernel", ("tensor", "fsdp")),  # (4d, d): row-parallel
    ]
    layer_axis = (None,) if scan_layers else ()
    rules = [(pattern, layer_axis + spec) for pattern, spec in block_rules]
    rules.append((r"(tok|pos)_embed/embedding", ("fsdp",)))  # (vocab | context, d)
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
        logits = nnx.merge(graphdef, state).logits(window)
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


# Sizes by name (`--preset`): about 350 M, 1 B and 2 B parameters at a 32 k vocabulary (synthetic
# tokens), and a tiny one for tests. Each size flag given on the command line overrides its preset.
DEFAULT_SIZES = {"layers": 2, "d_model": 128, "heads": 4, "context": 64, "vocab": VOCAB}
PRESETS = {
    "tiny": {"layers": 2, "d_model": 64, "heads": 4, "context": 32, "vocab": 1024},
    "350m": {"layers": 24, "d_model": 1024, "heads": 16, "context": 2048, "vocab": 32768},
    "1b": {"layers": 20, "d_model": 2048, "heads": 16, "context": 2048, "vocab": 32768},
    "2b": {"layers": 24, "d_model": 2560, "heads": 20, "context": 2048, "vocab": 32768},
}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The size and fast-decoder flags, shared with benchmarks/bench_transformer.py."""
    parser.add_argument("--preset", choices=sorted(PRESETS), help="named sizes; size flags override them")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--context", type=int, help="tokens per training window")
    parser.add_argument("--vocab", type=int, help="256 trains on bytes of stdlib source; any other on synthetic tokens")
    parser.add_argument(
        "--remat",
        nargs="?",
        const="full",
        default=None,
        choices=["none", *REMAT_POLICIES],
        help="rematerialise each block (nnx.remat): bare --remat recomputes it whole; or a policy name",
    )
    parser.add_argument("--attention", choices=ATTENTION_CHOICES, default="auto", help="auto: cuDNN where it can run")
    parser.add_argument("--position", choices=POSITION_CHOICES, default="learned")
    parser.add_argument(
        "--scan-layers", action="store_true", help="stacked blocks run by nnx.scan: compile time flat in depth"
    )
    parser.add_argument(
        "--loss-chunk",
        type=int,
        default=0,
        help="project to the vocabulary and take the cross-entropy this many positions at a time (0: whole logits)",
    )


def resolve_sizes(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the size flags left out from `--preset` (or the defaults)."""
    sizes = {**DEFAULT_SIZES, **PRESETS.get(args.preset, {})}
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def module_options(args: argparse.Namespace) -> dict:
    """TransformerLM's keyword arguments (less `tied` and `rngs`) from the parsed flags."""
    return {
        "vocab": args.vocab,
        "context": args.context,
        "layers": args.layers,
        "d_model": args.d_model,
        "heads": args.heads,
        "remat": args.remat or False,
        "attention": args.attention,
        "position": args.position,
        "scan_layers": args.scan_layers,
        "output": "hidden" if args.loss_chunk else "logits",
        "stages": getattr(args, "pipeline", None) is not None,
        "context_parallel": getattr(args, "context_parallel", "ring"),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mesh",
        default=None,
        help='data,fsdp,tensor sizes, or named axes such as "context=4,data=2"; one may be -1 '
        '(default "1,4,2" on 8 devices, else "-1,1,1")',
    )
    parser.add_argument(
        "--context-parallel",
        choices=CONTEXT_PARALLEL_CHOICES,
        default="ring",
        help="with a context axis in --mesh: ring or all-gather attention over it (mf.layers.dot_product_attention)",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--pipeline",
        type=int,
        metavar="P",
        help="build the blocks on meshfit.pipeline.Stages; train on a stage=P x data mesh (--mesh context=C adds one)",
    )
    parser.add_argument("--microbatches", type=int, help="with --pipeline: microbatches per data replica (default P)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="gpipe", help="with --pipeline: the schedule")
    parser.add_argument("--repeats", type=int, default=1, help="with --pipeline --schedule circular: layer groups")
    parser.add_argument(
        "--untied-head", action="store_true", help="a separate output projection instead of reusing the token embedding"
    )
    parser.add_argument("--dtype-policy", default="float32", help='e.g. "mixed_bfloat16" (bf16 compute, f32 Adam)')
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
    return resolve_sizes(parser.parse_args(argv))


SCHEDULES = ("gpipe", "circular", "1f1b")


def parse_mesh(text: str | None) -> dict[str, int]:
    """`--mesh` as MeshStrategy's axes: "d,f,t" (data, fsdp, tensor) or named sizes, "context=4,data=2", with
    the data, fsdp and tensor axes the rules and pins name added at size 1 where not given."""
    if text is None:
        text = "1,4,2" if len(jax.devices()) == 8 else "-1,1,1"
    if "=" not in text:
        sizes = [int(s) for s in text.split(",")]
        if len(sizes) != 3:
            raise SystemExit(f"--mesh takes three sizes data,fsdp,tensor or name=size pairs. Received: {text!r}.")
        return dict(zip(("data", "fsdp", "tensor"), sizes, strict=True))
    try:
        named = {name.strip(): int(size) for name, size in (pair.split("=") for pair in text.split(","))}
    except ValueError:
        raise SystemExit(f'--mesh takes name=size pairs such as "context=4,data=2". Received: {text!r}.') from None
    return {**named, **{axis: 1 for axis in ("data", "fsdp", "tensor") if axis not in named}}


def make_strategy(args: argparse.Namespace, tied: bool) -> mf.strategies.MeshStrategy:
    """`--mesh`'s data x fsdp x tensor mesh with the Megatron rules, or with `--pipeline P` a stage=P x data
    mesh (and `--mesh context=C`'s axis) whose `Pipeline` runs the decoder's `Stages` (its other parameters
    replicated, the batch split)."""
    if args.pipeline is None:
        rules = sharding_rules(tied, scan_layers=args.scan_layers)
        return mf.strategies.MeshStrategy(axes=parse_mesh(args.mesh), rules=rules)
    context = {}
    if args.mesh is not None:
        context = {axis: size for axis, size in parse_mesh(args.mesh).items() if size != 1}
        if set(context) - {"context"}:
            raise SystemExit(
                f"--pipeline lays the devices out as stage={args.pipeline} x data; --mesh may add only a context "
                f"axis (--mesh context=2). Received: --mesh {args.mesh}."
            )
    pipeline = mf.strategies.Pipeline(
        microbatches=args.microbatches or args.pipeline, schedule=args.schedule, repeats=args.repeats
    )
    # fsdp=1, tensor=1: the axes the model pins its activations to (BATCH, heads) exist on the mesh.
    return mf.strategies.MeshStrategy(
        axes={"stage": args.pipeline, **context, "data": -1, "fsdp": 1, "tensor": 1}, pipeline=pipeline
    )


def load_data(args):
    """((x_train, y_train), (x_val, y_val), description): stdlib bytes at vocab 256, else synthetic tokens."""
    if args.vocab == VOCAB:
        text = load_corpus(args.max_bytes)
        train, val = make_datasets(text, args.context)
        return train, val, f"{len(text):,} bytes of stdlib source"
    n_train, n_val = args.batch_size * args.steps_per_epoch, args.batch_size * args.validation_steps
    x, y = synthetic_tokens(n_train + n_val, args.context, args.vocab, args.seed)  # one task, split
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:]), f"synthetic tokens (vocab {args.vocab:,})"


def main(argv=None, callbacks=()) -> dict:
    """Trains and samples; returns {"history", "val_loss", "sample", "model", "seconds"}.

    `callbacks` are added to `fit`'s (benchmarks/bench_restart.py times a resumed run with one).
    """
    args = parse_args(argv)
    start = time.perf_counter()
    if args.backup_dir and not args.no_compilation_cache:
        # From the start, so what compiles outside fit (step_report, the sampler) is cached too;
        # BackupAndRestore alone caches what fit compiles.
        mf.compilation_cache.use(os.path.join(args.backup_dir, mf.compilation_cache.BACKUP_CACHE_NAME))
    (x_train, y_train), (x_val, y_val), source = load_data(args)
    tied = not args.untied_head

    strategy = make_strategy(args, tied)
    chief = strategy.is_chief
    if chief:
        print(
            f"{source} -> {len(x_train):,} train / {len(x_val):,} validation "
            f"windows of {args.context} tokens; {jax.device_count()} devices ({jax.devices()[0].platform})"
        )
    options = module_options(args)
    compute_dtype = mf.mixed_precision.get(args.dtype_policy).compute_dtype

    def factory(remat=args.remat):
        return TransformerLM(**{**options, "remat": remat or False}, tied=tied, rngs=nnx.Rngs(args.seed))

    def build(remat=args.remat):
        with strategy.scope():
            # From a factory, the parameters are created in their sharded layout: no device ever
            # holds a whole one. An eager module is created whole, then sharded.
            module = factory(remat) if args.eager else lambda: factory(remat)
            if args.loss_chunk:
                model = ChunkedLossModel(module, chunk=args.loss_chunk, compute_dtype=compute_dtype, seed=args.seed)
                loss = None  # its compute_loss is the chunked cross-entropy
            else:
                model = mf.Model(module, seed=args.seed)
                loss = mf.losses.SparseCategoricalCrossentropy(from_logits=True)
            model.compile(
                optimizer=mf.optimizers.get("adam", learning_rate=args.learning_rate),
                loss=loss,
                steps_per_execution=args.steps_per_execution,
                dtype_policy=args.dtype_policy,
            )
        return model

    model = build()
    batch = (x_train[: args.batch_size], y_train[: args.batch_size])
    report = model.step_report(*batch)  # compiled for one batch, nothing run
    remat = remat_policy_name(args.remat)
    without_remat = build(remat=False).step_report(*batch) if remat else None
    if chief:
        model.summary()
        print_memory(model, report, without_remat)
    if args.report_only:
        return {"model": model, "report": report, "report_without_remat": without_remat}
    callbacks = list(callbacks)
    if args.backup_dir:
        # A record a second: a kill loses at most that to "down"; the table prints at the end of fit.
        goodput = mf.callbacks.Goodput(record_every=1.0)
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
    losses = history.history["loss"]
    val_losses = history.history["val_loss"]
    text_out = (
        sample(model.module, args.prompt, args.sample_len, args.temperature, args.seed) if args.vocab == VOCAB else None
    )
    elapsed = time.perf_counter() - start
    if chief:
        print(
            f"train loss {losses[0]:.3f} -> {losses[-1]:.3f}, validation loss {val_losses[0]:.3f} -> "
            f"{val_losses[-1]:.3f} nats/token ({elapsed:.1f} s, {strategy!r})"
        )
        if text_out is not None:
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
