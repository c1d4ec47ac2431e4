"""MoE health per layer: expert load (tokens per expert: min, max, coefficient of variation), the
fraction of tokens routed to no expert, router entropy, and each layer's load-balancing and z losses.

A forward hook on every router (the ``mlp.gate`` module, whose output is ``(logits [T, E],
top-k weights [T, K], top-k ids [T, K])``) adds, on the device, the layer's top-k counts per
expert (the per-expert token counts stage 2 derives from the same ids), the router probabilities
summed over tokens, the summed entropy and squared log-sum-exp, and the token count into one
``[L, 2E + 3]`` buffer. Nothing is read on the host there: :meth:`MoeHealth.collect` all-reduces
the buffer once per logging step, reads it with one copy, and resets it. Forward passes re-run by
activation checkpointing during backward, evaluation passes, and a pipeline stage's shape-inference
forward (:attr:`MoeHealth.paused`) are not counted.

Definitions per layer over a step (T tokens, K experts per token, C_e top-k counts, P_e summed
router probabilities): load-balancing loss ``E * sum_e (C_e / T) (P_e / T)`` (the formula the
training loss uses), z-loss ``mean_t logsumexp(logits_t)^2``, router entropy
``mean_t -sum_e p_te log p_te`` (nats; ``log E`` is uniform), dropped fraction
``1 - sum_e C_e / (K T)``: 0 by construction here, since FastSparseMoE has no capacity limit and
every token reaches its K experts; it is measured, not assumed.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

from ..layout import all_reduce_sum


def _in_backward() -> bool:
    if torch.compiler.is_compiling():
        # A traced forward (trainer --compile) cannot ask for the graph task; its hooks are traced
        # into the forward graph, and a recomputation during backward replays that graph's ops only.
        return False
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # pragma: no cover - older torch
        return False


class MoeHealth:
    """Accumulates router statistics of ``modules`` (the model, or this rank's pipeline stages)."""

    def __init__(self, modules: Iterable[nn.Module], num_layers: int, num_experts: int, top_k: int,
                 device: torch.device) -> None:
        self.L, self.E, self.K = num_layers, num_experts, top_k
        self.buf = torch.zeros(num_layers, 2 * num_experts + 3, dtype=torch.float64, device=device)
        self.enabled = True
        #: ``() -> bool``: True while a forward must not be counted (a pipeline's shape inference)
        self.paused = lambda: False
        self.handles = []
        for mod in modules:
            for name, sub in mod.named_modules():
                if name.endswith("mlp.gate"):
                    layer = int(name.split("layers.")[1].split(".")[0])
                    self.handles.append(sub.register_forward_hook(self._hook(layer)))
        if not self.handles:
            raise ValueError("MoeHealth found no router (mlp.gate) module to watch")

    def _hook(self, layer: int):
        E = self.E

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.enabled or self.paused() or _in_backward():
                return
            with torch.no_grad():
                logits, idx = output[0], output[-1]
                lf = logits.detach().float().reshape(-1, E)
                logp = torch.log_softmax(lf, dim=-1)
                p = logp.exp()
                row = self.buf[layer]
                row[:E] += torch.bincount(idx.reshape(-1), minlength=E).to(row.dtype)
                row[E:2 * E] += p.sum(0).double()
                row[2 * E] += (-(p * logp).sum(-1)).sum().double()
                row[2 * E + 1] += torch.logsumexp(lf, dim=-1).square().sum().double()
                row[2 * E + 2] += lf.shape[0]

        return hook

    def collect(self, group: Any) -> dict[str, Any]:
        """The step's per-layer statistics summed over ``group`` (one all-reduce, one host read);
        resets the buffer. Lists are indexed by layer."""
        all_reduce_sum(self.buf, group)
        b = self.buf.to("cpu", copy=True)  # a copy: on the CPU .cpu() would alias the buffer zeroed next
        self.buf.zero_()
        E, K = self.E, self.K
        out: dict[str, list[Any]] = {k: [] for k in (
            "moe_tokens_per_expert", "moe_load_min", "moe_load_max", "moe_load_cv", "moe_dropped_frac",
            "moe_router_entropy", "moe_lb_loss", "moe_z_loss")}
        for layer in range(self.L):
            c, probs, ent, z, T = b[layer, :E], b[layer, E:2 * E], b[layer, 2 * E], b[layer, 2 * E + 1], b[layer, 2 * E + 2]
            T = float(T)
            mean = float(c.mean())
            out["moe_tokens_per_expert"].append([int(v) for v in c.tolist()])
            out["moe_load_min"].append(float(c.min()))
            out["moe_load_max"].append(float(c.max()))
            out["moe_load_cv"].append(float(c.std(unbiased=False)) / mean if mean > 0 else 0.0)
            out["moe_dropped_frac"].append(1.0 - float(c.sum()) / (K * T) if T > 0 else 0.0)
            out["moe_router_entropy"].append(float(ent) / T if T > 0 else 0.0)
            out["moe_lb_loss"].append(E * float(((c / T) * (probs / T)).sum()) if T > 0 else 0.0)
            out["moe_z_loss"].append(float(z) / T if T > 0 else 0.0)
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def plot_moe(records: list[dict[str, Any]], heatmap_path: str, imbalance_path: str, title: str = ""
             ) -> dict[str, Any]:
    """A heat map of expert load over training (one panel per layer: a row per expert, a column per
    step, the expert's share of the layer's routed slots relative to uniform) and a line chart of
    load imbalance (max / mean and CV per layer). Returns the matrices drawn, ``{"load": [L x [E, S]]}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    recs = [r for r in records if "moe_tokens_per_expert" in r]
    if not recs:
        raise ValueError("no MoE health records to plot")
    steps = [r["step"] for r in recs]
    counts = np.array([r["moe_tokens_per_expert"] for r in recs], dtype=np.float64)  # [S, L, E]
    S, L, E = counts.shape
    mean = counts.mean(-1, keepdims=True)
    rel = np.divide(counts, mean, out=np.zeros_like(counts), where=mean > 0)
    mats = [rel[:, layer, :].T for layer in range(L)]  # [E, S]
    fig, axes = plt.subplots(L, 1, figsize=(8, 1.2 + 0.35 * E * L), dpi=110, squeeze=False)
    for layer, ax in enumerate(axes[:, 0]):
        im = ax.imshow(mats[layer], aspect="auto", interpolation="nearest", cmap="viridis",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, E - 0.5, -0.5))
        ax.set_ylabel(f"layer {layer}\nexpert")
        fig.colorbar(im, ax=ax, label="load / mean")
    axes[-1, 0].set_xlabel("step")
    if title:
        axes[0, 0].set_title(f"expert load: {title}")
    fig.tight_layout()
    fig.savefig(heatmap_path)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    for layer in range(L):
        ax1.plot(steps, [r["moe_load_max"][layer] / max(np.mean(r["moe_tokens_per_expert"][layer]), 1e-12)
                         for r in recs], label=f"layer {layer}", lw=1)
        ax2.plot(steps, [r["moe_load_cv"][layer] for r in recs], label=f"layer {layer}", lw=1)
    ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax1.set_ylabel("max load / mean load")
    ax2.set_ylabel("coefficient of variation of load")
    for ax in (ax1, ax2):
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(f"load imbalance: {title}")
    fig.tight_layout()
    fig.savefig(imbalance_path)
    plt.close(fig)
    return {"load": mats}
