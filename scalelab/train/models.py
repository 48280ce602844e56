"""Small models for 2-D fields: a CNN, an MLP and a patch transformer; the byte-level language model (gpt) is in
train/gpt.py and built here too.

No BatchNorm (GroupNorm / LayerNorm instead): its statistics are per rank, which would break the
data-parallel equivalence a lab checks (1 worker x 2B == 2 workers x B).
"""
from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Conv blocks (conv 3x3, GroupNorm, ReLU, 2x2 pool while the field is large enough), then a linear head."""

    def __init__(self, in_channels: int, size: int, classes: int, width: int = 32, depth: int = 2):
        super().__init__()
        layers, c = [], in_channels
        for i in range(depth):
            out = width * min(2 ** i, 4)
            layers += [nn.Conv2d(c, out, 3, padding=1), nn.GroupNorm(min(8, out), out), nn.ReLU()]
            if size >= 4:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            c = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


class MLP(nn.Module):
    """Flattened field -> `depth` hidden layers of `width` -> classes."""

    def __init__(self, in_channels: int, size: int, classes: int, width: int = 128, depth: int = 2):
        super().__init__()
        dims = [in_channels * size * size] + [width] * depth
        layers = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(nn.Flatten(), *layers, nn.Linear(dims[-1], classes))

    def forward(self, x):
        return self.net(x)

    def unit_sizes(self) -> list[int]:
        """Parameters of each pipeline unit (the layers of `net`, in order)."""
        return [sum(p.numel() for p in layer.parameters()) for layer in self.net]

    def forward_units(self, x, first: int, last: int):
        """Run pipeline units [first, last) on x."""
        return self.net[first:last](x)

    def keep_units(self, first: int, last: int) -> None:
        """Keep only units [first, last): a pipeline stage (its parameters keep the serial model's names)."""
        self.net = self.net[first:last]


class PatchTransformer(nn.Module):
    """4x4 patches -> tokens with learned positions -> pre-norm encoder -> mean pool -> classes."""

    patch = 4

    def __init__(self, in_channels: int, size: int, classes: int, width: int = 32, depth: int = 2):
        super().__init__()
        tokens = (size // self.patch) ** 2
        self.embed = nn.Linear(in_channels * self.patch ** 2, width)
        self.pos = nn.Parameter(torch.zeros(1, tokens, width))
        heads = 4 if width % 4 == 0 else 1
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        # a pipeline stage lacks the parts of other stages (keep_units): it runs what it has
        if self.embed is not None:
            p = self.patch
            b, c, h, w = x.shape
            x = x.unfold(2, p, p).unfold(3, p, p)                # b, c, h/p, w/p, p, p
            x = x.permute(0, 2, 3, 1, 4, 5).reshape(b, (h // p) * (w // p), c * p * p)
            x = self.embed(x) + self.pos
        for layer in self.encoder.layers:  # what nn.TransformerEncoder does without masks, stage by stage
            x = layer(x)
        if self.head is not None:
            x = self.head(self.norm(x.mean(dim=1)))
        return x

    # pipeline units: 0 = patch embedding and positions, 1..depth = encoder blocks, depth + 1 = norm and head
    def unit_sizes(self) -> list[int]:
        """Parameters of each pipeline unit."""
        blocks = [sum(p.numel() for p in layer.parameters()) for layer in self.encoder.layers]
        embed = sum(p.numel() for p in self.embed.parameters()) + self.pos.numel()
        head = sum(p.numel() for m in (self.norm, self.head) for p in m.parameters())
        return [embed, *blocks, head]

    def forward_units(self, x, first: int, last: int):
        """Run pipeline units [first, last) on x (the whole model: every part present)."""
        saved = self.embed, self.pos, self.norm, self.head, dict(self.encoder.layers._modules)
        try:
            self.keep_units(first, last)
            return self(x)
        finally:
            self.embed, self.norm, self.head = saved[0], saved[2], saved[3]
            self.pos = saved[1]
            self.encoder.layers._modules.clear()
            self.encoder.layers._modules.update(saved[4])

    def keep_units(self, first: int, last: int) -> None:
        """Keep only units [first, last): a pipeline stage (its parameters keep the serial model's names)."""
        if first > 0:
            self.embed, self.pos = None, None
        if last < len(self.encoder.layers) + 2:
            self.norm, self.head = None, None
        for key in list(self.encoder.layers._modules):  # by key, not del layers[i]: that renumbers the rest
            if not first <= int(key) + 1 < last:
                del self.encoder.layers._modules[key]


MODELS = {"cnn": SmallCNN, "mlp": MLP, "transformer": PatchTransformer}


def build_model(model_spec, in_channels: int, size: int, classes: int, seed: int) -> nn.Module:
    """The model the spec names, initialised from `seed` (identical on every rank before any broadcast). For the
    gpt, `size` is the sequence length (its samples are 1-D)."""
    if model_spec.name == "gpt":
        from .gpt import build_gpt
        model = build_gpt(model_spec, size, seed)  # sample_shape: (seq_len,)
        layers = model.blocks
    else:
        torch.manual_seed(seed)
        model = MODELS[model_spec.name](in_channels, size, classes, width=model_spec.width, depth=model_spec.depth)
        model.sample_shape = (in_channels, size, size)  # what one input sample looks like (pipeline stages ask)
        layers = model.encoder.layers if model_spec.activation_checkpointing else []
    for layer in layers:
        if model_spec.activation_checkpointing:
            checkpointed(layer)
        if model_spec.compile:  # in place, block by block: parameter names stay (checkpoints, shards, stages)
            layer.compile()
    return model


def checkpointed(module: nn.Module) -> nn.Module:
    """Activation checkpointing of `module`, in place: its forward keeps only its input for backward and runs
    again during backward to rebuild the rest (compute traded for activation memory). Parameter names stay."""
    from torch.utils.checkpoint import checkpoint
    from .memory import SavedTensorBytes
    inner = module.forward

    def forward(*args, **kwargs):
        if SavedTensorBytes.active is not None and torch.is_grad_enabled():
            for a in args:
                SavedTensorBytes.active.add(a)  # the one tensor a checkpointed block keeps
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    return module
