"""What a stage sees of one decoder layer: the layer, its Linears and their formats, a runner over the
calibration inputs, and hooks that hand a stage the inputs of the modules it observes."""
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from llmc.quant.qtypes import QuantArgs, QuantizedWeight

COMPUTE_DTYPE = torch.float32


class LayerRunner:
    """Runs one decoder layer (or a module of it) over all calibration samples, in batches, with the model's own
    attention."""

    def __init__(self, skeleton: nn.Module, config, seq_len: int, batch_size: int = 8):
        rotary = type(skeleton.model.rotary_emb)(config=config)
        position_ids = torch.arange(seq_len).unsqueeze(0)
        probe = torch.zeros(1, seq_len, config.hidden_size, dtype=COMPUTE_DTYPE)
        self.positions = dict(
            attention_mask=None,  # sdpa is causal without a mask; samples have no padding
            position_ids=position_ids,
            position_embeddings=rotary(probe, position_ids),
        )
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, module: nn.Module, hidden: torch.Tensor, positional: bool = True) -> torch.Tensor:
        outputs = []
        for batch in hidden.split(self.batch_size):
            out = module(batch, **self.positions) if positional else module(batch)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs)


@dataclass
class LayerWork:
    """What a stage gets for one decoder layer."""

    layer: nn.Module
    prefix: str  # the layer's full name, e.g. model.layers.3
    linears: dict[str, nn.Linear]  # the stage's own selection, by full name
    plan: dict[str, QuantArgs]  # every Linear of the layer some stage quantizes, with its format
    runner: LayerRunner | None


class Stage(Protocol):
    config: object  # the recipe stage
    quantizes: bool

    def observed_modules(self, work: LayerWork) -> dict[str, nn.Module]: ...

    def record(self, name: str, inputs: torch.Tensor) -> None: ...

    def process(self, work: LayerWork) -> dict[str, QuantizedWeight]: ...


@contextmanager
def recording(modules: dict[str, nn.Module], record: Callable[[str, torch.Tensor], None]):
    """Calls record(name, input) for each batch that reaches one of the modules."""

    def hook_for(name: str):
        def hook(module, args, kwargs):
            record(name, args[0] if args else kwargs["hidden_states"])

        return hook

    handles = [module.register_forward_pre_hook(hook_for(name), with_kwargs=True) for name, module in modules.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
