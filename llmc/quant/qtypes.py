"""One description of a quantization format and the arithmetic every algorithm, the packer and the runtime share.

The conventions are compressed-tensors': signed integer codes in [-2^(b-1), 2^(b-1) - 1], float8 E4M3 values in
[-448, 448] or float4 E2M1 values in [-6, 6] (held as float8, which represents each exactly), symmetric scale
absmax / ((qmax - qmin) / 2), asymmetric zero points in the signed code range, W = (q - zero_point) * scale.
Two scale encodings beyond plain floats: NVFP4's `tensor_group` keeps each group's scale as float8 E4M3 relative to
one float32 global scale per tensor (448 * 6 / absmax), and the MX formats' E8M0 scales are powers of two chosen from
each group's absmax. Activations use the same arithmetic on [tokens, features], with scales per token (or per token
group) computed on the fly when dynamic, or one calibrated scale per tensor when static (NVFP4: dynamic group scales
under a calibrated global scale, `dynamic: local`).
"""
from dataclasses import dataclass
from typing import Literal, get_args

import torch

Bits = Literal[2, 3, 4, 8]
Kind = Literal["int", "float"]  # float: E4M3 at 8 bits, E2M1 at 4
Strategy = Literal["tensor", "channel", "group", "tensor_group", "block", "token"]
ActOrder = Literal["static", "group"]
Observer = Literal["minmax", "mse"]
ScaleDtype = Literal["float8_e4m3fn", "uint8"]  # compressed-tensors' names: FP8 group scales (NVFP4), E8M0 (MX)
Dynamic = Literal[False, True, "local"]  # local: per-group scales at run time under a calibrated global scale
CHOICES = {
    "num_bits": get_args(Bits), "type": get_args(Kind), "strategy": get_args(Strategy),
    "actorder": (None, *get_args(ActOrder)), "observer": get_args(Observer),
    "scale_dtype": (None, *get_args(ScaleDtype)), "dynamic": get_args(Dynamic),
}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
FP4_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the 3-bit magnitude code's values; bit 3 is the sign
MX_GROUP_SIZE = 32
FP4_LAYOUTS = {("tensor_group", 16, "float8_e4m3fn"), ("group", MX_GROUP_SIZE, "uint8")}


@dataclass(frozen=True)
class QuantArgs:
    """A frozen dataclass rather than a pydantic model so that the runtime imports without pydantic; recipes still
    validate it as a field (pydantic checks the Literals, forbids unknown keys and reports __post_init__'s errors)."""

    __pydantic_config__ = {"extra": "forbid"}

    num_bits: Bits = 4
    type: Kind = "int"  # float: float8 E4M3
    symmetric: bool = True
    strategy: Strategy = "group"
    group_size: int | None = 128
    block_structure: tuple[int, int] | None = None  # strategy block: [rows, columns] of each weight block
    dynamic: Dynamic = False  # activations: scales computed per input at run time, no calibration
    # columns quantized in decreasing Hessian-diagonal order (GPTQ); "group" also regroups them, needing g_idx
    actorder: ActOrder | None = None
    # weight ranges: min/max, or each group's range shrunk to the factor of least quantization error (data-free)
    observer: Observer = "minmax"
    scale_dtype: ScaleDtype | None = None  # None: scales in the model's dtype

    def __post_init__(self) -> None:
        for name, allowed in CHOICES.items():  # pydantic checks these too; direct construction needs it here
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, not {getattr(self, name)!r}")
        if self.grouped and (self.group_size is None or self.group_size <= 0):
            raise ValueError(f"strategy {self.strategy!r} needs a positive group_size")
        if self.actorder == "group" and self.strategy != "group":
            raise ValueError("actorder 'group' needs strategy 'group'")
        if self.type == "float" and (self.num_bits not in (4, 8) or not self.symmetric):
            raise ValueError("type 'float' is float8 E4M3 (num_bits 8) or float4 E2M1 (num_bits 4), symmetric")
        if self.is_fp4 and (self.strategy, self.group_size, self.scale_dtype) not in FP4_LAYOUTS:
            raise ValueError("float4 E2M1 is NVFP4 (strategy tensor_group, group_size 16, scale_dtype float8_e4m3fn) or "
                             f"MXFP4 (strategy group, group_size {MX_GROUP_SIZE}, scale_dtype uint8): the layouts engines read")
        if self.type == "int" and self.scale_dtype is not None:
            raise ValueError("scale_dtype is for float formats (NVFP4's float8 scales, MX's E8M0); int scales are plain")
        if self.strategy == "tensor_group" and (self.type, self.num_bits, self.scale_dtype) != ("float", 4, "float8_e4m3fn"):
            raise ValueError("strategy 'tensor_group' is NVFP4's: type float, num_bits 4, scale_dtype float8_e4m3fn")
        if self.scale_dtype == "float8_e4m3fn" and self.strategy != "tensor_group":
            raise ValueError("scale_dtype float8_e4m3fn needs strategy tensor_group (NVFP4)")
        if self.scale_dtype == "uint8" and (self.strategy, self.group_size) != ("group", MX_GROUP_SIZE):
            raise ValueError(f"scale_dtype uint8 (MX's E8M0 scales) needs strategy group with group_size {MX_GROUP_SIZE}")
        if self.dynamic == "local" and self.strategy != "tensor_group":
            raise ValueError("dynamic 'local' (group scales at run time under a calibrated global scale) needs strategy tensor_group")
        if self.observer == "mse" and self.dynamic:
            raise ValueError("observer 'mse' searches weight ranges once; dynamic scales are min/max at run time")
        if self.strategy == "token" and not self.dynamic:
            raise ValueError("strategy 'token' needs dynamic: true (per-token scales exist only at run time)")
        if not self.grouped and self.group_size is not None:
            object.__setattr__(self, "group_size", None)
        if self.strategy == "block" and self.block_structure is None:
            object.__setattr__(self, "block_structure", (128, 128))
        if self.strategy != "block" and self.block_structure is not None:
            raise ValueError("block_structure needs strategy 'block'")
        if self.block_structure is not None:
            object.__setattr__(self, "block_structure", tuple(self.block_structure))

    @property
    def grouped(self) -> bool:
        return self.strategy in ("group", "tensor_group")

    @property
    def is_fp4(self) -> bool:
        return self.type == "float" and self.num_bits == 4

    @property
    def is_mx(self) -> bool:
        return self.scale_dtype == "uint8"

    @property
    def qmin(self) -> float:
        return -self.qmax if self.type == "float" else -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> float:
        if self.type == "float":
            return FP4_MAX if self.num_bits == 4 else FP8_MAX
        return (1 << (self.num_bits - 1)) - 1

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.type == "float" else torch.int8

    def describe(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        if self.grouped:
            granularity = f"g{self.group_size}"
        elif self.strategy == "block":
            granularity = "block{}x{}".format(*self.block_structure)
        else:
            granularity = self.strategy
        order = f" actorder={self.actorder}" if self.actorder else ""
        order += " mse" if self.observer == "mse" else ""
        name = f"fp{self.num_bits}" if self.type == "float" else f"int{self.num_bits}"
        name = {"uint8": f"mx{name}", "float8_e4m3fn": f"nv{name}"}.get(self.scale_dtype, name)
        dynamic = {True: " dynamic", "local": " dynamic local"}.get(self.dynamic, "")
        return f"{name} {kind} {granularity}{dynamic}{order}"


def static_input_name(acts: QuantArgs | None) -> str | None:
    """The calibrated tensor a Linear's quantized inputs need: the per-tensor scale of static activations, or the
    global scale under which NVFP4's dynamic local group scales are computed; None when fully dynamic."""
    if acts is None or acts.dynamic is True:
        return None
    return "input_global_scale" if acts.dynamic == "local" else "input_scale"


def kv_scale_names(kv_cache: QuantArgs) -> tuple[str, str]:
    """The attention module's calibrated KV tensors: k_scale / v_scale, or NVFP4's k_global_scale / v_global_scale."""
    return ("k_global_scale", "v_global_scale") if kv_cache.dynamic == "local" else ("k_scale", "v_scale")


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # int8, or float8_e4m3fn holding E4M3 or E2M1 values; same shape as the weight
    # [out, 1] channel, [out, in / group_size] group, [out / rows, in / columns] block, [1] tensor; what codes are
    # multiplied by (tensor_group: the float8 group scale divided by global_scale, in float32)
    scale: torch.Tensor
    zero_point: torch.Tensor  # int8, shaped like scale; all zero when symmetric
    args: QuantArgs
    g_idx: torch.Tensor | None = None  # int32 [in]: the group of each input column, when actorder is "group"
    input_activations: QuantArgs | None = None  # how the Linear's inputs are quantized (W8A8, FP8), if they are
    global_scale: torch.Tensor | None = None  # float32 [1], strategy tensor_group only

    def rows(self, start: int, end: int) -> "QuantizedWeight":
        """Output rows start:end, e.g. one Linear's share of weights quantized stacked (not for per-tensor scales)."""
        g_idx = None if self.g_idx is None else self.g_idx.clone()  # own storage: safetensors refuses shared tensors
        global_scale = None if self.global_scale is None else self.global_scale.clone()
        return QuantizedWeight(
            self.codes[start:end].clone(), self.scale[start:end].clone(), self.zero_point[start:end].clone(), self.args,
            g_idx, self.input_activations, global_scale,
        )

    def to(self, device: torch.device) -> "QuantizedWeight":
        g_idx = None if self.g_idx is None else self.g_idx.to(device)
        global_scale = None if self.global_scale is None else self.global_scale.to(device)
        return QuantizedWeight(self.codes.to(device), self.scale.to(device), self.zero_point.to(device), self.args, g_idx,
                               self.input_activations, global_scale)

    def dequantize(self) -> torch.Tensor:
        if self.g_idx is not None:
            return dequantize_columns(self.codes, self.scale[:, self.g_idx], self.zero_point[:, self.g_idx])
        return dequantize(self.codes, self.scale, self.zero_point, self.args)


def _padded(x: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, (-x.shape[1]) % columns, 0, (-x.shape[0]) % rows))


def group_view(x: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """A [out, in] weight (or [tokens, features] activation) laid out so that reductions over the last dim follow
    the strategy; blocks and a ragged last activation group are zero-padded."""
    if args.strategy == "tensor":
        return x.reshape(1, 1, -1)
    if args.strategy in ("channel", "token"):
        return x.reshape(x.shape[0], 1, x.shape[1])
    if args.strategy == "block":
        rows, columns = args.block_structure
        padded = _padded(x, rows, columns)
        blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // columns, columns)
        return blocks.transpose(1, 2).reshape(blocks.shape[0], blocks.shape[2], rows * columns)
    if x.shape[1] % args.group_size:
        if args.dynamic is not True:
            raise ValueError(f"group_size {args.group_size} does not divide {x.shape[1]} input columns")
        x = _padded(x, 1, args.group_size)
    return x.reshape(x.shape[0], x.shape[1] // args.group_size, args.group_size)


def ungroup_view(grouped: torch.Tensor, shape: torch.Size, args: QuantArgs) -> torch.Tensor:
    if args.strategy == "block":
        rows, columns = args.block_structure
        blocks = grouped.reshape(grouped.shape[0], grouped.shape[1], rows, columns).transpose(1, 2)
        return blocks.reshape(grouped.shape[0] * rows, grouped.shape[1] * columns)[: shape[0], : shape[1]]
    if args.grouped:
        return grouped.reshape(shape[0], -1)[:, : shape[1]]
    return grouped.reshape(shape)


def observe_minmax(weight: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    grouped = group_view(weight, args)
    return grouped.amin(dim=-1), grouped.amax(dim=-1)


MSE_SHRINK_STEPS = 20  # range factors 1.00, 0.99, ..., 0.81
MSE_NORM = 2.4  # the error norm GPTQ's reference code searches with: between mean-square and max error


def observe_range(
    weight: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype, global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (row, group)'s min/max, or with observer mse the shrunk min/max whose quantized values are closest
    to the weight: outliers clipped in exchange for a finer grid for everything else."""
    min_vals, max_vals = observe_minmax(weight, args)
    if args.observer != "mse":
        return min_vals, max_vals
    grouped = group_view(weight, args).float()
    best_error = torch.full(min_vals.shape, torch.inf, device=min_vals.device)
    best_min, best_max = min_vals.clone(), max_vals.clone()
    for step in range(MSE_SHRINK_STEPS):
        factor = 1 - step / 100
        scale, zero_point = compute_qparams(min_vals * factor, max_vals * factor, args, scale_dtype, global_scale)
        shape = (*grouped.shape[:2], 1)
        scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
        rounded = dequantize_columns(quantize_columns(grouped, scale, zero_point, args), scale, zero_point).float()
        error = (rounded - grouped).abs().pow(MSE_NORM).sum(dim=-1).reshape(min_vals.shape)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_min = torch.where(better, min_vals * factor, best_min)
        best_max = torch.where(better, max_vals * factor, best_max)
    return best_min, best_max


def global_scale_of(absmax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor scale: the largest group scale, absmax / 6, lands on float8's largest value, 448."""
    absmax = absmax.float().amax().clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(FP8_MAX * FP4_MAX / absmax, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def mx_scale(absmax: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """An MX group's power-of-two scale: absmax rounded to a power of two (up from 1.75 x one, the E2M1 mantissa's
    halfway point), over the element type's largest power of two (4 for E2M1, 256 for E4M3); its E8M0 code is the
    exponent + 127, kept within 0..255."""
    absmax = absmax.float()
    bits = absmax.view(torch.int32) + (1 << 21)  # float32's 23-bit mantissa: + 0.25 of an exponent step
    power = (bits & 0x7F800000).view(torch.float32)  # sign and mantissa dropped
    offset = 2 if args.num_bits == 4 else 8  # floor(log2(6)), floor(log2(448))
    exponent = (torch.floor(torch.log2(power)) - offset).clamp(-127, 128)
    return torch.exp2(exponent)


def compute_qparams(
    min_vals: torch.Tensor, max_vals: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype,
    global_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zero points of the observed ranges. Float4/float8 scale encodings keep float32 scales that are
    exactly what the artifact's encoding stores (E8M0 powers of two; float8 values over the global scale)."""
    min_vals = min_vals.float().clamp(max=0)
    max_vals = max_vals.float().clamp(min=0)
    if args.is_mx:
        scale = mx_scale(torch.maximum(-min_vals, max_vals), args)
    elif args.strategy == "tensor_group":
        if global_scale is None:
            raise ValueError("strategy tensor_group: the tensor's global scale is needed (global_scale_of)")
        scale = torch.maximum(-min_vals, max_vals) / args.qmax * global_scale
        scale = scale.clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
        scale = torch.where(scale == 0, torch.finfo(torch.float8_e4m3fn).eps, scale) / global_scale
    else:
        if args.symmetric:
            scale = torch.maximum(-min_vals, max_vals) / ((args.qmax - args.qmin) / 2)
        else:
            scale = (max_vals - min_vals) / (args.qmax - args.qmin)
        # the stored scale is what the consumer multiplies by, so quantize with exactly that value
        scale = scale.to(scale_dtype)
        scale = torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale)
    if args.symmetric:
        zero_point = torch.zeros_like(scale, dtype=torch.int8)
    else:
        zero_point = torch.round(args.qmin - min_vals / scale.float()).clamp(args.qmin, args.qmax).to(torch.int8)
    if args.strategy == "tensor":
        return scale.reshape(1), zero_point.reshape(1)
    return scale, zero_point


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """The nearest float4 E2M1 value, ties to the even mantissa (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4), keeping
    the sign of x even on zero, as compressed-tensors' cast does."""
    magnitude = x.abs()
    index = sum((magnitude >= bound) if even_above else (magnitude > bound)
                for bound, even_above in ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                                          (3.5, True), (5.0, False)))
    return torch.tensor(E2M1_MAGNITUDES, device=x.device)[index] * torch.sign(x)


def quantize_columns(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """Elementwise rounding onto the grid; scale and zero_point broadcast against x (e.g. [out, 1] per column)."""
    if args.is_fp4:
        return round_to_e2m1((x.float() / scale.float()).clamp(args.qmin, args.qmax)).to(torch.float8_e4m3fn)
    if args.type == "float":
        return (x.float() / scale.float()).clamp(args.qmin, args.qmax).to(torch.float8_e4m3fn)
    codes = torch.round(x.float() / scale.float() + zero_point)
    return codes.clamp(args.qmin, args.qmax).to(torch.int8)


def dequantize_columns(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    return (codes.to(scale.dtype) - zero_point.to(scale.dtype)) * scale


def quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    grouped = group_view(x, args)
    shape = (*grouped.shape[:2], 1)
    return ungroup_view(quantize_columns(grouped, scale.reshape(shape), zero_point.reshape(shape), args), x.shape, args)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    grouped = group_view(codes.to(scale.dtype), args)
    shape = (*grouped.shape[:2], 1)
    return ungroup_view(dequantize_columns(grouped, scale.reshape(shape), zero_point.reshape(shape)), codes.shape, args)


def weight_global_scale(weight: torch.Tensor, args: QuantArgs) -> torch.Tensor | None:
    return global_scale_of(weight.abs().amax()) if args.strategy == "tensor_group" else None


def quantize_weight(
    weight: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype | None = None, global_scale: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Round-to-nearest on the observed ranges: the base every algorithm starts from. tensor_group: the weight's own
    global scale unless one is given (shared by Linears that engines fuse, q/k/v and gate/up)."""
    scale_dtype = scale_dtype or weight.dtype
    if global_scale is None:
        global_scale = weight_global_scale(weight, args)
    scale, zero_point = compute_qparams(*observe_range(weight, args, scale_dtype, global_scale), args, scale_dtype, global_scale)
    return QuantizedWeight(quantize(weight, scale, zero_point, args), scale, zero_point, args, global_scale=global_scale)


def fake_quantize(weight: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    return quantize_weight(weight, args).dequantize().to(weight.dtype)


def quantize_activation(
    x: torch.Tensor, args: QuantArgs, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., features] -> codes [tokens, features] and their scale: per token (group) when dynamic, else the
    calibrated per-tensor scale; dynamic local (NVFP4): per token group under static_scale, the calibrated global
    scale."""
    flat = x.reshape(-1, x.shape[-1]).float()
    if args.dynamic == "local":
        scale, zero_point = compute_qparams(*observe_minmax(flat, args), args, torch.float32, static_scale.float().reshape(1))
    elif static_scale is None:
        scale, zero_point = compute_qparams(*observe_minmax(flat, args), args, torch.float32)
    else:
        scale, zero_point = static_scale.float().reshape(1), torch.zeros(1, dtype=torch.int8, device=x.device)
    return quantize(flat, scale, zero_point, args), scale


def fake_quantize_activation(x: torch.Tensor, args: QuantArgs, static_scale: torch.Tensor | None = None) -> torch.Tensor:
    codes, scale = quantize_activation(x, args, static_scale)
    zero_point = torch.zeros_like(scale, dtype=torch.int8)
    return dequantize(codes, scale, zero_point, args).reshape(x.shape).to(x.dtype)
