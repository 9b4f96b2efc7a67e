"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): the router (dense: llmc keeps it unquantized) picks each token's top-k
experts, tokens are grouped by expert, each expert runs its stacked gate/up and its down Linear (on the kernels the
loader picks for their format) over its own tokens only, and the weighted outputs are summed back per token in
expert order, as transformers sums them."""
from typing import Protocol

import torch
from torch import nn
from transformers.activations import ACT2FN

from llmc.checkpoints.calibration_moe import top_k_routing
from llmc.checkpoints.families import MoeLayout


class LinearLoader(Protocol):
    """What the block needs of models/loader.py's WeightLoader (layers import nothing from models): Linears, the
    named projections stacked into one, on the kernels their format gets."""

    def linear(self, names: list[str]) -> nn.Module: ...


class SparseMoeBlock(nn.Module):
    def __init__(self, config, layout: MoeLayout, prefix: str, weights: LinearLoader):
        super().__init__()
        experts = [f"{prefix}.{layout.expert(index)}" for index in range(layout.num_experts(config))]
        self.router = weights.linear([f"{prefix}.{layout.router}"])
        self.gate_up = nn.ModuleList(weights.linear([f"{expert}.{layout.gate}", f"{expert}.{layout.up}"]) for expert in experts)
        self.down = nn.ModuleList(weights.linear([f"{expert}.{layout.down}"]) for expert in experts)
        self.num_experts = len(experts)
        self.top_k = config.num_experts_per_tok
        self.renormalize = layout.renormalizes(config)
        self.act_fn = ACT2FN[config.hidden_act]

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up[index](x).chunk(2, dim=-1)
        return self.down[index](self.act_fn(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = top_k_routing(self.router(x), self.top_k, self.renormalize)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.every_expert(x, weights, experts)
        return self.grouped(x, weights, experts)

    # under torch.compile (--compile) this runs eagerly: its shapes come from the routing, and dynamo would
    # recompile the loop for every new count of tokens per expert
    @torch.compiler.disable
    def grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The (token, expert) choices sorted by expert; each expert gathers its tokens, and its weighted outputs are
        added back at their rows."""
        choices = experts.flatten()
        order = choices.argsort(stable=True)
        rows, choice_weights = order // self.top_k, weights.flatten()[order]
        counts = torch.bincount(choices, minlength=self.num_experts).tolist()  # the one host sync of the block
        output = torch.zeros_like(x)
        start = 0
        for index, count in enumerate(counts):
            if count:
                mine = slice(start, start + count)
                routed = self.expert(index, x[rows[mine]]) * choice_weights[mine, None]
                output.index_add_(0, rows[mine], routed.to(output.dtype))
            start += count
        return output

    def every_expert(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, the unrouted ones weighted zero: static shapes and no host sync, which a
        CUDA graph capture needs. It reads every expert's weights, num_experts / top_k times what one token needs."""
        routing = torch.zeros(len(x), self.num_experts, device=x.device).scatter_(1, experts, weights)
        output = torch.zeros_like(x)
        for index in range(self.num_experts):
            output += (self.expert(index, x) * routing[:, index, None]).to(output.dtype)
        return output


def moe_block(config, layout: MoeLayout | None, layer_index: int, prefix: str, weights: LinearLoader) -> nn.Module | None:
    """The decoder layer's MoE MLP (layout: the family's, Family.moe; prefix: the layer's, model.layers.N); None where
    the layer's MLP is dense (a dense family, or a Qwen3-MoE layer in `mlp_only_layers` or off `decoder_sparse_step`)."""
    if layout is None or not layout.is_sparse(config, layer_index):
        return None
    return SparseMoeBlock(config, layout, prefix, weights)
