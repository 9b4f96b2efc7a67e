"""AutoRound (Cheng et al., 2023, Intel's auto-round): for each decoder layer, sign gradient descent on every targeted
weight's rounding offset V (the code is round(w / s + V)) and on each group's min/max factors (the range quantized
is [min x f_min, max x f_max], f in [0, 1]), minimising the mean-square error between the layer's output with its
weights fake-quantized and the full-precision model's output. As in the reference: the layer's inputs come from the
already quantized layers before it, its targets from the full-precision model (a second stream of activations the
stage carries from layer to layer), a learning rate of 1 / steps decaying linearly to 0, batches drawn from the
shuffled samples, and the step of lowest loss kept. The codes are then written as every other stage writes them."""
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import nn
from torch.func import functional_call

from llmc.checkpoints.families import Family
from llmc.quant.layer import COMPUTE_DTYPE, LayerWork, quantizing_inputs_of
from llmc.quant.qtypes import (
    QuantArgs,
    QuantizedWeight,
    group_view,
    observe_minmax,
    observe_range,
    ungroup_view,
)
from llmc.quant.stage import StageRole, StageRun, register_stage
from llmc.quant.weight_stage import WeightStage


class AutoRoundStage(WeightStage):
    """Learned rounding and ranges for integer weight formats (W4A16, W3A16, W2A16, W8A16, and the int weights of
    W4A8 / W4AFP8 / W8A8), a layer at a time against the full-precision model's outputs."""

    type: Literal["autoround"]
    steps: int = Field(200, gt=0)  # sign-gradient steps per decoder layer (auto-round's iters)
    lr: float | None = Field(None, gt=0)  # None: 1 / steps, or 2 / steps at 3 bits or fewer with 1000 steps or more
    minmax_lr: float | None = Field(None, gt=0)  # the min/max factors' rate; None: lr
    batch_size: int = Field(8, gt=0)  # calibration samples per step
    samples: int | None = Field(None, gt=0)  # the first N calibration samples (of each rank's share); None: all
    seed: int = 0  # the order batches are drawn in
    # symmetric formats: each group's scale oriented so that its largest-magnitude weight lands exactly on the code
    # -2^(b-1), as auto-round does (a negative scale where that weight is positive), which uses one more level than
    # round-to-nearest's absmax / (2^(b-1) - 0.5) grid; false: that grid
    full_range: bool = True
    needs_calibration: ClassVar[bool] = True

    @model_validator(mode="after")
    def _integer_groups(self) -> "AutoRoundStage":
        weights = self.weights
        if weights.type != "int" or weights.strategy not in ("group", "channel"):
            raise ValueError("weights: autoround learns integer codes with group or channel scales; float formats "
                             "(NVFP4, MXFP4, FP8) and tensor or block scales use type: rtn or gptq")
        if weights.actorder is not None:
            raise ValueError("weights.actorder is GPTQ's column order; autoround learns every column at once")
        return self

    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return (2.0 if self.steps >= 1000 and self.weights.num_bits <= 3 else 1.0) / self.steps


class RoundStraight(torch.autograd.Function):
    """round() whose gradient is the identity (straight-through)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class LearnedRounding:
    """One Linear's weight with its learnable offsets and range factors."""

    def __init__(self, weight: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype, full_range: bool = False):
        self.weight, self.args, self.scale_dtype, self.full_range = weight.detach().float(), args, scale_dtype, full_range
        self.min_vals, self.max_vals = observe_minmax(self.weight, args)
        start_min, start_max = observe_range(self.weight, args, scale_dtype)  # the mse observer's shrunk range, if asked
        self.offset = torch.zeros_like(group_view(self.weight, args), requires_grad=True)
        self.min_factor = torch.where(self.min_vals != 0, start_min / self.min_vals, 1.0).requires_grad_()
        self.max_factor = torch.where(self.max_vals != 0, start_max / self.max_vals, 1.0).requires_grad_()

    @property
    def rounding_parameters(self) -> list[torch.Tensor]:
        return [self.offset]

    @property
    def range_parameters(self) -> list[torch.Tensor]:
        return [self.min_factor, self.max_factor]

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales (float32, holding what the artifact stores) and zero points (float) of the current ranges,
        differentiable in the factors; without full_range and with unit factors, exactly compute_qparams' RTN ones."""
        args = self.args
        low = self.min_vals.clamp(max=0) * self.min_factor.clamp(0, 1)
        high = self.max_vals.clamp(min=0) * self.max_factor.clamp(0, 1)
        if not args.symmetric:
            scale = (high - low) / (args.qmax - args.qmin)
        elif self.full_range:  # the largest magnitude lands on qmin: a negative scale where that weight is positive
            scale = torch.where(high > -low, high, low) / args.qmin
        else:
            scale = torch.maximum(-low, high) / ((args.qmax - args.qmin) / 2)
        scale = scale + (scale.to(self.scale_dtype).float() - scale).detach()  # the stored precision, gradient kept
        scale = torch.where(scale == 0, torch.finfo(self.scale_dtype).eps, scale)
        if args.symmetric:
            return scale, torch.zeros_like(scale)
        return scale, RoundStraight.apply(args.qmin - low / scale).clamp(args.qmin, args.qmax)

    def _codes(self, scale: torch.Tensor, zero_point: torch.Tensor, rounding) -> torch.Tensor:
        grouped = group_view(self.weight, self.args) / scale.unsqueeze(-1) + self.offset
        return (rounding(grouped) + zero_point.unsqueeze(-1)).clamp(self.args.qmin, self.args.qmax)

    def fake_quantized(self) -> torch.Tensor:
        """The weight quantized and dequantized, differentiable in the offsets and factors."""
        scale, zero_point = self.qparams()
        codes = self._codes(scale, zero_point, RoundStraight.apply)
        return ungroup_view((codes - zero_point.unsqueeze(-1)) * scale.unsqueeze(-1), self.weight.shape, self.args)

    def quantized(self) -> QuantizedWeight:
        with torch.no_grad():
            scale, zero_point = self.qparams()
            codes = ungroup_view(self._codes(scale, zero_point, torch.round), self.weight.shape, self.args)
        return QuantizedWeight(codes.to(torch.int8), scale.to(self.scale_dtype), zero_point.to(torch.int8), self.args)


class AutoRoundRun(StageRun):
    config: AutoRoundStage

    def __init__(self, config: AutoRoundStage, scale_dtype: torch.dtype, family: Family):
        super().__init__(config, scale_dtype, family)
        self.inputs: list[torch.Tensor] = []
        self.full_precision: torch.Tensor | None = None  # the full-precision model's activations at this layer's input

    def observed_modules(self, work: LayerWork) -> dict[str, nn.Module]:
        self.inputs = []
        return {work.prefix: work.layer}

    def record(self, name: str, inputs: torch.Tensor) -> None:
        self.inputs.append(inputs)

    def process(self, work: LayerWork) -> dict[str, QuantizedWeight]:
        inputs = torch.cat(self.inputs)
        self.inputs = []
        if self.full_precision is None or self.full_precision.shape != inputs.shape:
            # the first layer (or the first after a resume, which replays only the quantized stream)
            self.full_precision = inputs
        targets = work.runner(work.layer, self.full_precision)
        self.full_precision = targets
        learned = {name: LearnedRounding(linear.weight.data, self.config.weights, self.scale_dtype, self.config.full_range)
                   for name, linear in work.linears.items()}
        self._train(work, learned, inputs, targets)
        results = {}
        for name, rounding in learned.items():
            results[name] = rounding.quantized()
            work.linears[name].weight.data = results[name].dequantize().to(work.linears[name].weight.dtype)
        return results

    def _train(self, work: LayerWork, learned: dict[str, LearnedRounding], inputs: torch.Tensor, targets: torch.Tensor) -> None:
        config, runner, ranks = self.config, work.runner, work.ranks
        count = min(len(inputs), config.samples or len(inputs))
        batch_size = min(config.batch_size, count)
        lr = config.learning_rate()
        minmax_lr = config.minmax_lr or lr
        groups = [(rounding.rounding_parameters, lr) for rounding in learned.values()]
        groups += [(rounding.range_parameters, minmax_lr) for rounding in learned.values()]
        parameters = [parameter for group, _ in groups for parameter in group]
        leaves = {name: f"{name.removeprefix(work.prefix + '.')}.weight" for name in learned}
        autocast = torch.autocast(runner.device.type, dtype=runner.compute_dtype, enabled=runner.compute_dtype != COMPUTE_DTYPE)
        hooks = [quantizing_inputs_of(work.linears[name], acts, None) for name, acts in self._dynamic_inputs(work).items()]
        trainable = [parameter for parameter in work.layer.parameters() if parameter.requires_grad]
        for parameter in trainable:  # the layer's own parameters stay as they are: no gradient computed for them
            parameter.requires_grad_(False)
        generator = torch.Generator().manual_seed(config.seed)
        order: list[int] = []
        best_loss, best = float("inf"), [parameter.detach().clone() for parameter in parameters]
        try:
            for step in range(config.steps):
                if len(order) < batch_size:  # reshuffled when a batch no longer fits, as auto-round's sampler does
                    order = torch.randperm(count, generator=generator).tolist()
                batch, order = order[:batch_size], order[batch_size:]
                replaced = {leaves[name]: rounding.fake_quantized() for name, rounding in learned.items()}
                samples = inputs[batch].to(runner.device)
                with autocast:
                    output = functional_call(work.layer, replaced, (samples,), runner.positions)
                output = output[0] if isinstance(output, tuple) else output
                loss = nn.functional.mse_loss(output.float(), targets[batch].to(runner.device))
                loss.backward()
                (total,) = ranks.sum_floats(float(loss.detach()))
                if total < best_loss:
                    best_loss, best = total, [parameter.detach().clone() for parameter in parameters]
                decay = 1 - step / config.steps
                with torch.no_grad():
                    for group, rate in groups:
                        for parameter in group:
                            parameter -= rate * decay * torch.sign(ranks.sum(parameter.grad))
                            parameter.grad = None
        finally:
            for hook in hooks:
                hook.remove()
            for parameter in trainable:
                parameter.requires_grad_(True)
        with torch.no_grad():
            for parameter, kept in zip(parameters, best):
                parameter.copy_(kept)

    def _dynamic_inputs(self, work: LayerWork) -> dict[str, QuantArgs]:
        """The targeted Linears whose inputs the runtime quantizes per token: trained on inputs quantized so. Static
        input scales are calibrated after this stage, so those Linears train on full-precision inputs."""
        acts = self.config.input_activations
        return {name: acts for name in work.linears} if acts is not None and acts.dynamic is True else {}


register_stage(AutoRoundStage, AutoRoundRun, StageRole.WEIGHT)
