"""K-FAC (Martens & Grosse 2015; KFC for convolutions, Grosse & Martens 2016), distributed the KAISA way
(Pauloski et al., SC'21), written out so a lab can read it.

For a layer y = W a (bias folded into W by appending a 1 to a), the Fisher block of W is approximated by a
Kronecker product of two small matrices:

    A = E[a a^T]      (d_in+1 x d_in+1)  from the layer's inputs, captured in a forward hook
    G = E[g g^T]      (d_out x d_out)    from the gradients of the layer's outputs, captured in a backward hook

and the preconditioned gradient is (G (x) A + damping I)^-1 vec(grad W). With the eigendecompositions
A = Qa diag(da) Qa^T and G = Qg diag(dg) Qg^T that is

    V = Qg [ (Qg^T grad Qa) / (dg da^T + damping) ] Qa^T

so a step costs two small matrix products per layer once the eigenvectors are known. The factors are running
averages refreshed every `factor_every` steps; the eigendecompositions (the expensive part) every `inv_every`.

Distributed (KAISA). Each layer's factors are reduced to one rank, its *inverse worker* (layers go round-robin),
which decomposes them. `grad_worker_fraction` f decides what happens next, on W ranks with n = max(1, round(f W))
*gradient workers* per layer:
    f = 1    (COMM-OPT)  every rank receives the eigen-decompositions and preconditions every layer itself:
                         most memory (every rank holds every layer's factors), no gradient broadcast.
    f = 1/W  (MEM-OPT)   only the inverse worker holds a layer's decomposition; it preconditions the gradient
                         and broadcasts the result: least memory, one gradient broadcast per layer per step.
    between  (HYBRID)    n gradient workers per layer, each broadcasting to W/n ranks.
`stats()` counts the bytes each rank broadcast and holds, so the trade-off can be measured.

The gradients given to step() must already be averaged over the ranks (DDP has done so by the time the loop
calls the optimizer).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

def _dist_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def layer_inputs(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows `a` of A = E[a a^T] for one forward: (rows, d_in + 1), with the 1 of the bias appended."""
    if isinstance(module, nn.Conv2d):
        x = F.unfold(x, module.kernel_size, dilation=module.dilation, padding=module.padding, stride=module.stride)
        x = x.transpose(1, 2).reshape(-1, x.shape[1])  # one row per output position: its receptive field
    else:
        x = x.reshape(-1, x.shape[-1])
    if module.bias is not None:
        x = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)
    return x


def output_grads(module: nn.Module, g: torch.Tensor, batch: int) -> torch.Tensor:
    """The rows `g` of G = E[g g^T]: (rows, d_out), scaled by the batch so that G does not shrink with the
    1/batch of a mean loss."""
    if isinstance(module, nn.Conv2d):
        g = g.transpose(1, -1).reshape(-1, g.shape[1])
    else:
        g = g.reshape(-1, g.shape[-1])
    return g * batch


def factor(rows: torch.Tensor) -> torch.Tensor:
    """E[r r^T] over the rows."""
    return rows.t() @ rows / rows.shape[0]


def grad_matrix(module: nn.Module) -> torch.Tensor:
    """The layer's gradient as one (d_out, d_in [+1]) matrix, bias last."""
    g = module.weight.grad.reshape(module.weight.shape[0], -1)
    if module.bias is not None:
        g = torch.cat([g, module.bias.grad.reshape(-1, 1)], dim=1)
    return g


def set_grad_matrix(module: nn.Module, v: torch.Tensor) -> None:
    """Write a (d_out, d_in [+1]) matrix back into the layer's weight and bias gradients."""
    if module.bias is not None:
        module.bias.grad.copy_(v[:, -1])
        v = v[:, :-1]
    module.weight.grad.copy_(v.reshape(module.weight.grad.shape))


def eigen(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (clamped at 0: a factor is positive semi-definite) and eigenvectors of a symmetric matrix."""
    d, q = torch.linalg.eigh(m.double())
    return d.clamp(min=0).to(m.dtype).contiguous(), q.to(m.dtype).contiguous()  # eigh gives column-major q


def precondition(grad: torch.Tensor, a_eig, g_eig, damping: float) -> torch.Tensor:
    """(G (x) A + damping I)^-1 applied to the gradient matrix, through the factors' eigendecompositions."""
    (da, qa), (dg, qg) = a_eig, g_eig
    v = qg.t() @ grad @ qa
    v = v / (dg.unsqueeze(1) * da.unsqueeze(0) + damping)
    return qg @ v @ qa.t()


class _Layer:
    """One preconditioned layer: its hooks' captures, its factors and (where this rank holds them) their
    eigendecompositions."""

    def __init__(self, index: int, name: str, module: nn.Module):
        self.index, self.name, self.module = index, name, module
        self.a_rows = self.g_rows = None
        self.A = self.G = None
        self.a_eig = self.g_eig = None
        self.seen = False   # factors captured at least once (the same on every rank: same model, same forward)
        self.ready = False  # decomposed: from now on its gradient is preconditioned


class KFAC(torch.optim.Optimizer):
    """SGD (with momentum and weight decay) on K-FAC-preconditioned gradients of every Linear and Conv2d layer;
    the other parameters (norms, embeddings) get their plain gradient. The learning rate lives in param_groups, so
    the loop's warm-up and schedule act on it as on any optimizer."""

    def __init__(self, model: nn.Module, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 damping: float = 0.003, factor_decay: float = 0.95, factor_every: int = 1, inv_every: int = 10,
                 kl_clip: float = 0.001, grad_worker_fraction: float = 1.0, factor_fn=None):
        self.inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.defaults, self.param_groups, self.state = self.inner.defaults, self.inner.param_groups, self.inner.state
        self.damping, self.factor_decay, self.kl_clip = damping, factor_decay, kl_clip
        self.factor_every, self.inv_every = factor_every, inv_every
        self.factor_fn = factor_fn  # a student's factor (optim.kfac_factor), checked on its first use
        self.steps = 0
        self.layers = [_Layer(i, name, m) for i, (name, m) in enumerate(
            (n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d)))]
        for layer in self.layers:
            layer.module.register_forward_hook(self._capture(layer))
        self.rank, self.world = _dist_world()
        self.grad_workers = max(1, min(self.world, round(grad_worker_fraction * self.world)))
        if self.world % self.grad_workers:
            raise ValueError(f"optim.kfac_grad_worker_fraction={grad_worker_fraction} gives {self.grad_workers} "
                             f"gradient workers per layer, which does not divide the {self.world} ranks: pick a "
                             f"fraction k/{self.world} with k dividing {self.world}")
        self.sent_bytes = 0
        self._groups()

    # -- KAISA's groups -------------------------------------------------------------------------------------
    def _groups(self) -> None:
        """Columns: the n gradient workers of a layer (ranks equal modulo W/n) receive its decomposition;
        blocks: W/n consecutive ranks, one gradient worker each, share its preconditioned gradient."""
        w, n = self.world, self.grad_workers
        self.block = w // n
        self.columns, self.blocks = {}, {}
        if w == 1:
            return
        for c in range(self.block):
            ranks = [r for r in range(w) if r % self.block == c]
            self.columns[c] = (ranks, dist.new_group(ranks) if len(ranks) > 1 else None)
        for b in range(n):
            ranks = list(range(b * self.block, (b + 1) * self.block))
            self.blocks[b] = (ranks, dist.new_group(ranks) if len(ranks) > 1 else None)

    def inverse_worker(self, layer: _Layer) -> int:
        """The rank that reduces and decomposes this layer's factors (round-robin over the layers)."""
        return layer.index % self.world

    def is_grad_worker(self, layer: _Layer) -> bool:
        """Whether this rank holds the layer's decomposition and preconditions its gradient itself."""
        return self.rank % self.block == self.inverse_worker(layer) % self.block

    def mode(self) -> str:
        """COMM-OPT (every rank a gradient worker), MEM-OPT (one per layer) or HYBRID."""
        if self.grad_workers == self.world:
            return "COMM-OPT"
        return "MEM-OPT" if self.grad_workers == 1 else "HYBRID"

    # -- hooks -------------------------------------------------------------------------------------------
    def _capture(self, layer):
        """Keep the layer's input rows and, through a hook on its output, its output-gradient rows."""
        def grad_hook(g):
            layer.g_rows = output_grads(layer.module, g.detach(), g.shape[0])

        def hook(module, inputs, output):
            if torch.is_grad_enabled() and output.requires_grad and self.steps % self.factor_every == 0:
                layer.a_rows = layer_inputs(module, inputs[0].detach())
                output.register_hook(grad_hook)
        return hook

    # -- the step ----------------------------------------------------------------------------------------
    def _update_factors(self) -> None:
        for layer in self.layers:
            if layer.a_rows is None or layer.g_rows is None:
                continue
            new_a, new_g = self._factor(layer.a_rows), self._factor(layer.g_rows)
            layer.a_rows = layer.g_rows = None
            layer.seen = True
            if self.world > 1:  # the mean over ranks, on the inverse worker only
                worker = self.inverse_worker(layer)
                for m in (new_a, new_g):
                    dist.reduce(m, dst=worker)
                    m /= self.world
                if self.rank != worker:
                    continue
            d = self.factor_decay if layer.A is not None else 0.0
            layer.A = new_a if layer.A is None else d * layer.A + (1 - d) * new_a
            layer.G = new_g if layer.G is None else d * layer.G + (1 - d) * new_g

    def _factor(self, rows: torch.Tensor) -> torch.Tensor:
        """The Kronecker factor of `rows` (n, d): the dense one, or the student's (optim.kfac_factor), whose result
        must be a (d, d) float tensor."""
        if self.factor_fn is None:
            return factor(rows)
        out = self.factor_fn(rows)
        d = rows.shape[1]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (d, d) or not out.is_floating_point():
            raise ValueError(f"optim.kfac_factor: for rows of shape {tuple(rows.shape)} it returned "
                             f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}; it must return the ({d}, {d}) "
                             "factor as a float tensor")
        return out.to(rows.dtype)

    def _update_inverses(self) -> None:
        for layer in self.layers:
            if not layer.seen:  # e.g. a Linear whose forward is never called (attention's out_proj)
                continue
            layer.ready = True
            worker = self.inverse_worker(layer)
            if self.rank == worker:
                layer.a_eig, layer.g_eig = eigen(layer.A), eigen(layer.G)
            if self.world == 1 or self.grad_workers == 1:
                continue
            ranks, group = self.columns[worker % self.block]
            if self.rank not in ranks or group is None:
                continue
            if self.rank != worker and layer.a_eig is None:  # the shapes, to receive into
                da, dg = self._dims(layer)
                layer.a_eig = (torch.zeros(da), torch.zeros(da, da))
                layer.g_eig = (torch.zeros(dg), torch.zeros(dg, dg))
            for t in (*layer.a_eig, *layer.g_eig):
                dist.broadcast(t, src=worker, group=group)
                if self.rank == worker:
                    self.sent_bytes += t.numel() * t.element_size() * (len(ranks) - 1)

    @staticmethod
    def _dims(layer: _Layer) -> tuple[int, int]:
        w = layer.module.weight
        return w[0].numel() + (layer.module.bias is not None), w.shape[0]

    def _precondition(self) -> float:
        """Replace every layer's gradient by its preconditioned one; returns sum(v . g) for the KL clip."""
        vg = 0.0
        for layer in self.layers:
            if layer.module.weight.grad is None or not layer.ready:
                continue  # no statistics (yet): the plain gradient
            grad = grad_matrix(layer.module)
            if self.is_grad_worker(layer):
                v = precondition(grad, layer.a_eig, layer.g_eig, self.damping)
            else:
                v = torch.empty_like(grad)  # filled by the broadcast below
            if self.world > 1 and self.block > 1:  # the gradient worker of this rank's block shares its result
                b = self.rank // self.block
                ranks, group = self.blocks[b]
                src = b * self.block + self.inverse_worker(layer) % self.block
                dist.broadcast(v, src=src, group=group)
                if self.rank == src:
                    self.sent_bytes += v.numel() * v.element_size() * (len(ranks) - 1)
            vg += float((v * grad).sum())
            set_grad_matrix(layer.module, v)
        return vg

    @torch.no_grad()
    def step(self, closure=None):
        """Update the factors and (every inv_every steps) their decompositions, precondition, clip, then SGD."""
        if self.steps % self.factor_every == 0:
            self._update_factors()
        if self.steps % self.inv_every == 0:
            self._update_inverses()
        vg = self._precondition()
        if self.kl_clip and vg > 0:
            lr = self.param_groups[0]["lr"]
            nu = min(1.0, math.sqrt(self.kl_clip / (lr * lr * vg)))
            for layer in self.layers:
                for p in layer.module.parameters(recurse=False):
                    if p.grad is not None:
                        p.grad.mul_(nu)
        self.steps += 1
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """The SGD state and the step count; factors re-accumulate after a resume (they are running averages
        held on different ranks), so a K-FAC resume is close to, not bit-equal with, an unbroken run."""
        return {"sgd": self.inner.state_dict(), "kfac_steps": self.steps}

    def load_state_dict(self, state):
        self.inner.load_state_dict(state["sgd"])
        self.steps = 0  # statistics start again: the first step refreshes factors and decompositions
        self.param_groups = self.inner.param_groups

    def stats(self) -> dict:
        """What this rank holds and sent: factor and decomposition bytes, bytes broadcast, the KAISA mode."""
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)
        held = sum(nbytes((layer.A, layer.G)) for layer in self.layers)
        eig = sum(nbytes((*(layer.a_eig or ()), *(layer.g_eig or ()))) for layer in self.layers)
        return {"mode": self.mode(), "grad_workers": self.grad_workers, "world": self.world,
                "factor_bytes": held, "eigen_bytes": eig, "sent_bytes": self.sent_bytes,
                "layers": len(self.layers)}


__all__ = ["KFAC", "layer_inputs", "output_grads", "factor", "grad_matrix", "eigen", "precondition"]
