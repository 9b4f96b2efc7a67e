"""Symmetric activation quantization in one Triton kernel, per token (dynamic) or with a static per-tensor scale:
the arithmetic of llmc.quant.qtypes.quantize_activation, which on GPU would otherwise be some fifteen small kernels
per Linear. One program per token: absmax, scale = absmax / ((qmax - qmin) / 2) (the float32 epsilon when 0), codes
= x / scale clamped, rounded half to even (int8) or cast to float8 E4M3 by torch. Imported only on GPU, or on CPU under
TRITON_INTERPRET=1 in the tests."""
import torch
import triton
import triton.language as tl

from llmc.quant.qtypes import QuantArgs

ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: adding and subtracting it rounds a float32 below 2^22 half to even
BLOCK = 1024


@triton.jit
def _quantize_rows_kernel(
    x, codes, scales, static_scale, K, stride_x, HALF_RANGE: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
    IS_FLOAT: tl.constexpr, STATIC: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_scale)
    else:
        absmax = tl.zeros([], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            values = tl.load(x + row * stride_x + start + offsets, mask=start + offsets < K, other=0.0).to(tl.float32)
            absmax = tl.maximum(absmax, tl.max(tl.abs(values), 0))
        scale = tl.math.div_rn(absmax, HALF_RANGE)
        scale = tl.where(scale == 0, EPS, scale)
        tl.store(scales + row, scale)
    for start in range(0, K, BLOCK):
        mask = start + offsets < K
        values = tl.load(x + row * stride_x + start + offsets, mask=mask, other=0.0).to(tl.float32)
        scaled = tl.minimum(tl.maximum(tl.math.div_rn(values, scale), QMIN), QMAX)
        if IS_FLOAT:  # float32 out, cast to float8 by torch: Triton's interpreter mis-rounds float8 across powers of 2
            quantized = scaled
        else:  # clamping first keeps the values where the magic number rounds exactly; then they are integers
            quantized = ((scaled + ROUND_MAGIC) - ROUND_MAGIC).to(tl.int8)
        tl.store(codes + row * K + start + offsets, quantized, mask=mask)


def quantize_activation_triton(
    x: torch.Tensor, args: QuantArgs, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as quantize_activation for symmetric int8 / float8 per-token or static per-tensor formats:
    [..., K] -> codes [tokens, K] and float32 scales [tokens, 1] (dynamic) or [1] (static)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    tokens, features = flat.shape
    is_float = args.type == "float"
    codes = torch.empty(tokens, features, dtype=torch.float32 if is_float else torch.int8, device=x.device)
    static = static_scale is not None
    scales = static_scale.float().reshape(1) if static else torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(tokens,)](
        flat, codes, scales, scales, features, flat.stride(0), HALF_RANGE=(args.qmax - args.qmin) / 2,
        QMIN=float(args.qmin), QMAX=float(args.qmax), IS_FLOAT=is_float, STATIC=static,
        EPS=torch.finfo(torch.float32).eps, BLOCK=BLOCK,
    )
    return (codes.to(torch.float8_e4m3fn) if is_float else codes), scales
