"""What a stage sees of one decoder layer: the layer, its Linears and their formats, a runner over the
calibration inputs, and hooks that hand a stage the inputs of the modules it observes."""
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from llmc.checkpoints.families import rope_layer_types, sliding_windows
from llmc.quant.kvcache import visible_keys
from llmc.quant.qtypes import QuantArgs, fake_quantize_activation
from llmc.quant.ranks import SINGLE, Ranks

COMPUTE_DTYPE = torch.float32
CPU = torch.device("cpu")


@contextmanager
def parameters_in(module: nn.Module, dtype: torch.dtype):
    """The module's parameters cast to dtype for the `with` body, then the very same float32 values restored: the
    forward runs in dtype while every algorithm keeps working on float32 weights."""
    if dtype == COMPUTE_DTYPE:
        yield
        return
    masters = [(parameter, parameter.data) for parameter in module.parameters()]
    for parameter, master in masters:
        parameter.data = master.to(dtype)
    try:
        yield
    finally:
        for parameter, master in masters:
            parameter.data = master


class LayerRunner:
    """Runs one decoder layer (or a module of it) over all calibration samples, in batches, with the model's own
    attention. With a bfloat16 compute dtype the forward passes run in bfloat16 (faster on CPU) and
    their outputs come back as float32. `select(index)` picks the layer whose positions (RoPE by layer type,
    sliding-window masks) the runs use."""

    def __init__(self, skeleton: nn.Module, config, seq_len: int, batch_size: int = 8, compute_dtype=COMPUTE_DTYPE,
                 device: torch.device = CPU):
        rotary = type(skeleton.model.rotary_emb)(config=config).to(device)
        position_ids = torch.arange(seq_len, device=device).unsqueeze(0)
        probe = torch.zeros(1, seq_len, config.hidden_size, dtype=COMPUTE_DTYPE, device=device)

        def positions(layer_type: str | None, window: int | None) -> dict:
            embeddings = rotary(probe, position_ids, layer_type) if layer_type else rotary(probe, position_ids)
            return dict(
                attention_mask=sliding_mask(seq_len, window, device),
                position_ids=position_ids,
                position_embeddings=tuple(part.to(compute_dtype) for part in embeddings),
            )

        layers = list(zip(rope_layer_types(config), sliding_windows(config)))
        by_kind = {kind: positions(*kind) for kind in set(layers)}
        self.layer_positions = [by_kind[kind] for kind in layers]
        self.positions = self.layer_positions[0]
        self.batch_size = batch_size
        self.compute_dtype = compute_dtype
        self.device = device

    def select(self, index: int) -> None:
        self.positions = self.layer_positions[index]

    @torch.no_grad()
    def __call__(self, module: nn.Module, hidden: torch.Tensor, positional: bool = True) -> torch.Tensor:
        outputs = []
        with parameters_in(module, self.compute_dtype):
            for batch in hidden.split(self.batch_size):  # hidden may wait in host memory, one batch at a time on the device
                batch = batch.to(self.device, self.compute_dtype, non_blocking=True)
                out = module(batch, **self.positions) if positional else module(batch)
                outputs.append((out[0] if isinstance(out, tuple) else out).to(hidden.device, COMPUTE_DTYPE))
        return torch.cat(outputs)


def sliding_mask(seq_len: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """[1, 1, seq, seq] True where a query sees a key within its window; None (plain causal) when every key fits."""
    if window is None or window >= seq_len:
        return None
    return visible_keys(seq_len, seq_len, window, device)[None, None]


@dataclass
class LayerWork:
    """What a stage gets for one decoder layer."""

    layer: nn.Module
    prefix: str  # the layer's full name, e.g. model.layers.3
    linears: dict[str, nn.Linear]  # the stage's own selection, by full name
    plan: dict[str, QuantArgs]  # every Linear of the layer some stage quantizes, with its format
    runner: LayerRunner | None
    ranks: Ranks = SINGLE  # the processes calibrating together, each on its share of the samples


def quantizing_inputs_of(module: nn.Module, args: QuantArgs, static_scale: torch.Tensor | None):
    """A forward pre-hook on `module` that fake-quantizes its input as the runtime quantizes it (dynamically, or by the
    calibrated static scale); its handle."""
    def hook(module, inputs):
        return (fake_quantize_activation(inputs[0], args, static_scale), *inputs[1:])

    return module.register_forward_pre_hook(hook)


@contextmanager
def recording(modules: dict[str, nn.Module], record: Callable[[str, torch.Tensor], None]):
    """Calls record(name, input) for each batch that reaches one of the modules, with the input as float32. Modules
    fed the same tensor get the same float32 tensor (GPTQ shares a Hessian by that identity)."""
    last: list[torch.Tensor | None] = [None, None]  # the last input seen, and its float32 version

    def as_float(inputs: torch.Tensor) -> torch.Tensor:
        if inputs is not last[0]:
            last[:] = [inputs, inputs.to(COMPUTE_DTYPE)]
        return last[1]

    def hook_for(name: str):
        def hook(module, args, kwargs):
            record(name, as_float(args[0] if args else kwargs["hidden_states"]))

        return hook

    handles = [module.register_forward_pre_hook(hook_for(name), with_kwargs=True) for name, module in modules.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
