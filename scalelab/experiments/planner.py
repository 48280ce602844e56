"""3D parallelism planning: lay dp x tp x pp onto nodes x GPUs, and estimate memory and traffic per GPU.

    from scalelab.experiments.planner import ModelShape, ClusterShape, plan
    p = plan(ModelShape.named("70b"), ClusterShape(nodes=8, gpus_per_node=8, gpu_gb=80), dp=2, tp=8, pp=4)
    p["feasible"], p["memory_gb"], p["links"]

Ranks are numbered tp innermost, then pp, then dp (Megatron's order), so a tensor-parallel group is consecutive
GPUs of one node whenever tp divides the GPUs per node. Each group's link is "intra" (inside a node: NVLink) if
all its ranks share a node, else "inter" (the network).

Memory per GPU (bytes), mixed-precision Adam: parameters `param_bytes` (2, bf16) + gradients `grad_bytes` (2) +
optimizer state `optim_bytes` (12: fp32 master weights and two moments) per parameter, for the P / (tp x pp)
parameters of this GPU's model shard, divided by dp as ZeRO `zero` (0-3) shards them; plus activations of the
micro-batches a 1F1B stage holds (at most pp), ~`act_bytes_per_token_layer` x hidden per token per layer (34
bytes x hidden in bf16 without recomputation, Korthikanti et al. 2022), split over tp.
Traffic per GPU per step, ring algorithms: data parallel 2(dp-1)/dp x gradient bytes (ZeRO-3: 3(dp-1)/dp: two
all-gathers and a reduce-scatter); tensor parallel 4 all-reduces of the activations per layer per micro-batch
(2 forward, 2 backward); pipeline parallel one activation forward and one gradient back per micro-batch.
These are estimates to choose a layout with, not measurements: lab 07 checks the memory arithmetic against the
engine on a small model.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelShape:
    """A transformer's size: what memory and traffic depend on."""

    params: float
    """Parameters."""
    layers: int
    """Transformer layers (pipeline stages split these)."""
    hidden: int
    """Hidden size (activations are tokens x hidden)."""
    seq: int = 4096
    """Tokens per sample."""
    micro_batch: int = 1
    """Samples per micro-batch."""

    @classmethod
    def named(cls, name: str) -> "ModelShape":
        """7b, 13b or 70b (Llama-2 shapes)."""
        shapes = {"7b": cls(6.7e9, 32, 4096), "13b": cls(13e9, 40, 5120), "70b": cls(70e9, 80, 8192)}
        if name not in shapes:
            raise ValueError(f"unknown model {name!r}; choose one of {', '.join(shapes)} or give a ModelShape")
        return shapes[name]


@dataclass
class ClusterShape:
    """Nodes of identical GPUs."""

    nodes: int = 1
    """Nodes."""
    gpus_per_node: int = 8
    """GPUs per node."""
    gpu_gb: float = 80.0
    """Memory per GPU, GB (1e9 bytes)."""
    intra_gbps: float = 300.0
    """Bandwidth between GPUs of a node, GB/s per GPU (NVLink)."""
    inter_gbps: float = 25.0
    """Bandwidth between nodes, GB/s per GPU (200 Gb/s InfiniBand)."""


def group_links(dp: int, tp: int, pp: int, gpus_per_node: int) -> dict:
    """Per group kind (tp, pp, dp): 'intra' if every group of that kind lies inside one node, else 'inter'."""
    def node(rank):
        return rank // gpus_per_node

    def rank(d, p, t):
        return (d * pp + p) * tp + t

    groups = {"tp": [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
              "pp": [[rank(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
              "dp": [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]}
    return {kind: "intra" if all(len({node(r) for r in g}) == 1 for g in gs) else "inter"
            for kind, gs in groups.items()}


def state_bytes_per_gpu(params: float, dp: int, tp: int = 1, pp: int = 1, zero: int = 3, param_bytes: float = 2,
                        grad_bytes: float = 2, optim_bytes: float = 12) -> float:
    """Parameters + gradients + optimizer state one GPU holds (fp32 Adam: param_bytes=4, grad_bytes=4,
    optim_bytes=8)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    shard = params / (tp * pp)
    p, g, o = shard * param_bytes, shard * grad_bytes, shard * optim_bytes
    return (p / dp if zero >= 3 else p) + (g / dp if zero >= 2 else g) + (o / dp if zero >= 1 else o)


def plan(model: ModelShape, cluster: ClusterShape, dp: int, tp: int, pp: int, zero: int = 3, micro: int = 8,
         act_bytes_per_token_layer: float = 34.0) -> dict:
    """Memory and traffic per GPU of a dp x tp x pp layout, its links, its bubble and whether it fits."""
    world, gpus = dp * tp * pp, cluster.nodes * cluster.gpus_per_node
    problems = []
    if world != gpus:
        problems.append(f"dp x tp x pp = {world} but the cluster has {gpus} GPUs")
    if model.layers % pp:
        problems.append(f"{model.layers} layers do not split into pp = {pp} equal stages")
    if model.hidden % tp:
        problems.append(f"hidden size {model.hidden} does not split over tp = {tp}")
    links = group_links(dp, tp, pp, cluster.gpus_per_node)
    state = state_bytes_per_gpu(model.params, dp, tp, pp, zero)
    tokens = model.seq * model.micro_batch
    act = act_bytes_per_token_layer * model.hidden * tokens * (model.layers / pp) / tp * min(pp, micro)
    memory = state + act
    grads = 2 * model.params / (tp * pp)  # bf16 gradients of this GPU's shard
    dp_bytes = (3 if zero >= 3 else 2) * (dp - 1) / dp * grads
    tp_bytes = 4 * (model.layers / pp) * micro * 2 * (tp - 1) / tp * 2 * tokens * model.hidden if tp > 1 else 0.0
    pp_bytes = 2 * micro * 2 * tokens * model.hidden if pp > 1 else 0.0
    bw = {"intra": cluster.intra_gbps * 1e9, "inter": cluster.inter_gbps * 1e9}
    seconds = {"dp": dp_bytes / bw[links["dp"]], "tp": tp_bytes / bw[links["tp"]], "pp": pp_bytes / bw[links["pp"]]}
    fits = memory <= 0.9 * cluster.gpu_gb * 1e9
    if not fits:
        problems.append(f"{memory / 1e9:.0f} GB per GPU is more than 90 % of {cluster.gpu_gb:g} GB")
    if tp > 1 and links["tp"] == "inter":
        problems.append("tensor-parallel groups cross nodes: every layer's all-reduces go over the network")
    return {"dp": dp, "tp": tp, "pp": pp, "zero": zero, "micro": micro, "world": world, "links": links,
            "state_gb": state / 1e9, "activation_gb": act / 1e9, "memory_gb": memory / 1e9,
            "traffic_gb": {"dp": dp_bytes / 1e9, "tp": tp_bytes / 1e9, "pp": pp_bytes / 1e9},
            "comm_s": seconds, "bubble": (pp - 1) / (micro + pp - 1), "fits": fits,
            "feasible": not problems, "problems": problems}


def layouts(model: ModelShape, cluster: ClusterShape, zero: int = 3, micro: int = 8) -> list[dict]:
    """Every dp x tp x pp that uses all GPUs (tp up to a node), best first: feasible, then least communication
    time, then least memory."""
    gpus = cluster.nodes * cluster.gpus_per_node
    out = []
    for tp in (t for t in range(1, cluster.gpus_per_node + 1) if cluster.gpus_per_node % t == 0):
        for pp in (p for p in range(1, gpus // tp + 1) if (gpus // tp) % p == 0):
            out.append(plan(model, cluster, gpus // (tp * pp), tp, pp, zero, micro))
    return sorted(out, key=lambda p: (not p["feasible"], sum(p["comm_s"].values()) + p["bubble"], p["memory_gb"]))
