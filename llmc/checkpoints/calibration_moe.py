"""The calibration stand-in for transformers' sparse mixture-of-experts blocks. transformers 5 keeps a block's experts
as fused 3-D parameters, but checkpoints (and vLLM) name them per expert, as 2-D Linears, and the layer-by-layer
driver loads, quantizes and writes Linears by those names. So each sparse block of the skeleton becomes a
CalibrationMoe: the router and every expert's gate, up and down as nn.Linears named as the checkpoint names them.
Its forward sends every token through every expert, so each expert's statistics (GPTQ's Hessians, AWQ's and
SmoothQuant's activations) cover the whole calibration set, while its output stays the router's top-k combination:
what transformers computes."""
from collections.abc import Callable

import torch
from torch import nn

from llmc.checkpoints.families import Family, MoeLayout


def top_k_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts [tokens, k] and their float32 softmax weights [tokens, k], renormalized to sum to
    1 when the family does (Mixtral always, Qwen3-MoE with norm_topk_prob)."""
    weights, experts = router_logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class Expert(nn.Module):
    """One expert's Linears under the checkpoint's names (Mixtral: w1 gate, w3 up, w2 down)."""

    def __init__(self, layout: MoeLayout, hidden_size: int, width: int):
        super().__init__()
        self.names = (layout.gate, layout.up, layout.down)
        self.add_module(layout.gate, nn.Linear(hidden_size, width, bias=False))
        self.add_module(layout.up, nn.Linear(hidden_size, width, bias=False))
        self.add_module(layout.down, nn.Linear(width, hidden_size, bias=False))

    def linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """(gate, up, down)."""
        return tuple(self.get_submodule(name) for name in self.names)


class CalibrationMoe(nn.Module):
    def __init__(self, config, layout: MoeLayout, activation: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        num_experts = layout.num_experts(config)
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(Expert(layout, config.hidden_size, layout.expert_width(config)) for _ in range(num_experts))
        self.top_k = config.num_experts_per_tok
        self.renormalize = layout.renormalizes(config)
        self.activation = activation

    def routing(self, tokens: torch.Tensor) -> torch.Tensor:
        """[tokens, experts]: each token's weight on each expert, zero off its top k."""
        weights, experts = top_k_routing(self.gate(tokens), self.top_k, self.renormalize)
        return torch.zeros(len(tokens), len(self.experts), device=tokens.device).scatter_(1, experts, weights)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        routing = self.routing(tokens)
        linears = [expert.linears() for expert in self.experts]
        # every expert's gate and up read this one tensor one after the other: GPTQ's recording sees one input, and
        # so accumulates one Hessian for all of them and solves them as one stacked weight
        products = [self.activation(gate(tokens)) * up(tokens) for gate, up, _ in linears]
        output = torch.zeros_like(tokens)
        for index, (_, _, down) in enumerate(linears):
            # unrouted tokens add exactly zero, so each token sums its experts in transformers' order
            output += (down(products[index]) * routing[:, index, None]).to(output.dtype)
            products[index] = None  # released as soon as used
        return output.reshape(hidden_states.shape)


def place_block(layer: nn.Module, name: str, block: nn.Module) -> None:
    """The block as the layer's submodule `name`. Under another name than `mlp` (Mixtral's block_sparse_moe) it is
    also the layer's plain, unregistered attribute `mlp`: transformers' decoder forward calls `self.mlp`, while
    module names and state dicts see the block once, under the checkpoint's name."""
    del layer.mlp
    layer.add_module(name, block)
    if name != "mlp":
        object.__setattr__(layer, "mlp", block)


def linearize_experts(skeleton: nn.Module, family: Family) -> None:
    """Each sparse MoE block of the (meta-device) skeleton replaced by a CalibrationMoe, in the same dtype."""
    layout, config = family.moe, skeleton.config
    if layout is None:
        return
    for index, layer in enumerate(skeleton.get_submodule(family.layers)):
        if layout.is_sparse(config, index):
            fused = layer.mlp
            with torch.device(fused.gate.weight.device):
                block = CalibrationMoe(config, layout, fused.experts.act_fn).to(fused.gate.weight.dtype)
            place_block(layer, layout.block, block)
