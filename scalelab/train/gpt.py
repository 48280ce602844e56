"""A decoder-only transformer language model on bytes (`model.name = gpt`), and what its speed means.

    spec = preset("tiny").with_overrides({"model.name": "gpt", "model.preset": "tiny", "data.source": "pysrc",
                                          "optim.name": "adamw", "optim.lr": 0.003})

The model is GPT-2's shape at byte level: token and position embeddings, `depth` pre-norm blocks (causal
self-attention through `F.scaled_dot_product_attention`, which picks a flash or memory-efficient kernel where the
device has one; a GELU MLP of 4 x width), a final norm and an untied head to 256 byte logits. It returns the logits
as (batch, 256, seq_len): the layout `F.cross_entropy` takes for a sequence, so the engine's loop, pipeline stages
and evaluation (argmax over dim 1: next-byte accuracy) use it as they use the classifiers. Presets: GPT_PRESETS
(run/field_groups.py), from `tiny` (seconds on a CPU) to `100m` (one GPU).

It cuts the way the engine's strategies need: pipeline units (embeddings | each block | norm and head) for
strategies pp and 3d (`unit_sizes`, `forward_units`, `keep_units`, as the mlp and the patch transformer offer), and
Megatron's tensor parallelism by heads and MLP (tensor_parallel.split_model: q, k and v column-parallel by heads,
the attention's out-projection row-parallel, the MLP column/row; embeddings, norms and head replicated).

Speed: a step event of a gpt run carries tokens/s and MFU, the model FLOPs utilisation:

    flops per token = 6 N + 12 L T d        (PaLM, Chowdhery et al. 2022, appendix B)

N the parameters that multiply (all but the two embedding tables, which are looked up), L blocks, T the sequence
length, d the width (heads x head size); 6 N is a forward and backward through the weights, 12 L T d the attention
scores and their weighted sums (counted for the whole T x T square, as PaLM counts them, though causal kernels skip
half). MFU = flops per token x tokens/s / the device's peak; PEAK_TFLOPS names each device's peak and its source.
On a CPU there is no trustworthy peak: MFU is null there, tokens/s is still measured.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: packed q, k, v projection, SDPA with is_causal, out-projection."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # under tensor parallelism: this rank's heads of each
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # b, heads, t, head size
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """width -> 4 x width -> GELU -> width."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A pre-norm decoder block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), CausalSelfAttention(width, heads)
        self.ln2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level decoder-only transformer; forward(ids (b, t)) -> logits (b, 256, t)."""

    def __init__(self, context: int, width: int, depth: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"{heads} heads do not divide the width {width}")
        self.context, self.width, self.depth, self.heads = context, width, depth, heads
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self._init_weights()
        self.flops_per_token = flops_per_token(self)
        """Model FLOPs per trained token (forward and backward), the whole model's, kept when a stage is cut."""
        self.tokens_per_sample = context
        self.sample_shape = (context,)  # what one input sample looks like (pipeline stages ask)

    def _init_weights(self) -> None:
        # GPT-2's: N(0, 0.02) weights, zero biases, the residual projections scaled by 1/sqrt(2 depth) so the
        # residual stream's variance does not grow with depth
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:
                std = 0.02 / math.sqrt(2 * self.depth) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, x):
        # a pipeline stage lacks the parts of other stages (keep_units): it runs what it has
        if self.embed is not None:
            x = self._embedded(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x)).transpose(1, 2)  # (b, 256, t): F.cross_entropy's layout for sequences
        return x

    def _embedded(self, x):
        ids = x.long()  # ids arrive as float32 (data/pysrc.py says why)
        return self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))

    # pipeline units: 0 = embeddings, 1..depth = blocks, depth + 1 = norm and head
    def unit_sizes(self) -> list[int]:
        """Parameters of each pipeline unit."""
        def size(*modules):
            return sum(p.numel() for m in modules for p in m.parameters())
        return [size(self.embed, self.pos), *(size(b) for b in self.blocks), size(self.norm, self.head)]

    def forward_units(self, x, first: int, last: int):
        """Run pipeline units [first, last) on x (the whole model: every part present)."""
        if first == 0:
            x = self._embedded(x)
        for i in range(max(first, 1), min(last, self.depth + 1)):
            x = self.blocks[i - 1](x)
        if last == self.depth + 2:
            x = self.head(self.norm(x)).transpose(1, 2)
        return x

    def keep_units(self, first: int, last: int) -> None:
        """Keep only units [first, last): a pipeline stage (its parameters keep the serial model's names)."""
        if first > 0:
            self.embed, self.pos = None, None
        if last < self.depth + 2:
            self.norm, self.head = None, None
        for key in list(self.blocks._modules):  # by key, not del blocks[i]: that renumbers the rest
            if not first <= int(key) + 1 < last:
                del self.blocks._modules[key]


def build_gpt(model_spec, context: int, seed: int) -> GPT:
    """The gpt the spec names (preset or width/depth/heads), initialised from `seed` (models.build_model applies
    activation checkpointing and torch.compile to its blocks)."""
    torch.manual_seed(seed)
    width, depth, heads = model_spec.shape()
    return GPT(context, width, depth, heads)


def flops_per_token(model: GPT) -> int:
    """6 N + 12 L T d (see the module docstring): N the parameters of every layer that multiplies."""
    looked_up = sum(p.numel() for m in (model.embed, model.pos) for p in m.parameters())
    n = sum(p.numel() for p in model.parameters()) - looked_up
    return 6 * n + 12 * model.depth * model.context * model.width


# Dense peaks in TFLOPS (no 2:4 sparsity), per precision the engine runs in: "fp32" is the plain FP32 rate (torch
# leaves TF32 matmuls off by default), "bf16" the tensor cores' BF16 rate with FP32 accumulation (fp16 runs use the
# same figure: it is equal on these parts). Sources: NVIDIA's data sheets (H100 Tensor Core GPU, H200, A100 80GB,
# L40S, L4, V100), the "with sparsity" figures halved. Matched against torch.cuda.get_device_name(), first hit wins.
PEAK_TFLOPS = (
    ("H100 PCIe", {"fp32": 51.0, "bf16": 756.0}, "NVIDIA H100 data sheet, PCIe"),
    ("H100 NVL", {"fp32": 60.0, "bf16": 835.0}, "NVIDIA H100 data sheet, NVL"),
    ("H100", {"fp32": 67.0, "bf16": 989.0}, "NVIDIA H100 data sheet, SXM"),
    ("GH200", {"fp32": 67.0, "bf16": 989.0}, "NVIDIA GH200 data sheet"),
    ("H200", {"fp32": 67.0, "bf16": 989.0}, "NVIDIA H200 data sheet, SXM"),
    ("A100", {"fp32": 19.5, "bf16": 312.0}, "NVIDIA A100 data sheet"),
    ("L40S", {"fp32": 91.6, "bf16": 362.0}, "NVIDIA L40S data sheet"),
    ("L4", {"fp32": 30.3, "bf16": 121.0}, "NVIDIA L4 data sheet"),
    ("V100", {"fp32": 15.7, "fp16": 125.0}, "NVIDIA V100 data sheet, SXM2 (no BF16 tensor cores)"),
)


def device_peak(device, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s of `device` at `precision`, where the figure comes from); (None, why) when unknown."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"no peak for device type {device.type!r}: MFU is reported on GPUs only"
    name = torch.cuda.get_device_name(device)
    key = "fp32" if precision == "fp32" else "bf16"
    for part, peaks, source in PEAK_TFLOPS:
        if part in name:
            peak = peaks.get(key) or (peaks.get("fp16") if precision == "fp16" else None)
            if peak is None:
                return None, f"{name} has no {precision} tensor-core peak in PEAK_TFLOPS"
            return peak * 1e12, f"{name}: {peak:g} TFLOPS {key} dense ({source})"
    return None, f"{name} is not in scalelab.train.gpt.PEAK_TFLOPS: MFU unknown"


def train_step_fn(model: GPT, x: torch.Tensor, y: torch.Tensor, batch: int, *, precision: str = "fp32",
                  fused: bool = False, compile_backend: str | None = None, lr: float = 3e-4):
    """(step, losses): `step()` trains `model` one step on the next `batch` windows of (x ids, y targets), wrapping
    round, the way the GPU check (gpt_bench) and lab 01's ladder (experiments.single_device.gpt_ladder) time it:
    next-byte cross-entropy under bf16 autocast ("bf16"; "fp32": none), backward, AdamW at `lr` (`fused`: one kernel
    for the whole update; otherwise torch's default for the device, for-each on a GPU). `compile_backend`:
    torch.compile of every block first (the first step compiles). Each step appends its loss, detached, to `losses`
    (no sync inside the step: read them after the timing)."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision {precision!r}: the gpt's timed step runs in 'fp32' or 'bf16'")
    if batch < 1 or len(x) < batch:
        raise ValueError(f"batch {batch} with {len(x)} windows: give 1 <= batch <= the windows")
    if compile_backend:
        for block in model.blocks:
            block.compile(backend=compile_backend)
    # fused=None, not False: False would force the slow per-parameter loop where torch picks for-each by default
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True if fused else None)
    device_type = next(model.parameters()).device.type
    autocast = torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16")
    batches, losses, at = len(x) // batch, [], [0]

    def step() -> None:
        i = at[0] % batches
        at[0] += 1
        xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
        with autocast:
            loss = F.cross_entropy(model(xb).float(), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    return step, losses


class Throughput:
    """The tokens/s and MFU fields of a gpt run's step events (nothing for the other models).

    ranks_per_replica: the devices that share one replica's batch (tp x pp; 1 for ddp and fsdp), so MFU is per
    device: flops per token x this replica's tokens/s / (peak x ranks_per_replica)."""

    def __init__(self, model, device, precision: str, ranks_per_replica: int = 1):
        self.flops = getattr(model, "flops_per_token", None)
        self.tokens = getattr(model, "tokens_per_sample", None)
        self.ranks = ranks_per_replica
        self.peak, self.peak_source = device_peak(device, precision) if self.flops else (None, "")

    def fields(self, samples: int, step_s: float) -> dict:
        """tokens_per_s (this replica's), flops_per_token, mfu (null where the peak is unknown), peak_tflops."""
        if not self.flops:
            return {}
        tokens_per_s = samples * self.tokens / step_s
        mfu = self.flops * tokens_per_s / (self.peak * self.ranks) if self.peak else None
        return {"tokens_per_s": tokens_per_s, "flops_per_token": self.flops, "mfu": mfu,
                "peak_tflops": self.peak / 1e12 if self.peak else None}


@torch.no_grad()
def held_out_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 64) -> float:
    """Mean next-byte cross-entropy (nats) of `model` on held-out windows (x ids, y targets)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(x), batch):
        total += float(F.cross_entropy(model(x[i:i + batch]).float(), y[i:i + batch], reduction="sum"))
    model.train(was_training)
    return total / y.numel()


def run_held_out_loss(run_dir) -> dict:
    """A finished gpt run's held-out loss, from its spec.json and model.pt, beside the unigram baseline (the loss of a
    model that knows only how often each byte occurs): {"loss", "unigram", "windows"} in nats per byte."""
    from pathlib import Path
    from ..data import pysrc
    from ..data.loader import build_eval_set
    from ..run.spec import load
    run_dir = Path(run_dir)
    spec = load(run_dir / "spec.json")
    if spec.model.name != "gpt":
        raise ValueError(f"{run_dir} trained model.name={spec.model.name!r}, not the gpt: it has no held-out loss here")
    width, depth, heads = spec.model.shape()
    model = GPT(spec.data.seq_len, width, depth, heads)
    model.load_state_dict(torch.load(run_dir / "model.pt", map_location="cpu"))
    x, y = build_eval_set(spec.data, spec.seed)
    return {"loss": held_out_loss(model, x, y), "unigram": pysrc.unigram_loss(y), "windows": len(x)}


__all__ = ["GPT", "Block", "CausalSelfAttention", "MLP", "build_gpt", "flops_per_token", "PEAK_TFLOPS",
           "device_peak", "train_step_fn", "Throughput", "held_out_loss", "run_held_out_loss", "VOCAB"]
