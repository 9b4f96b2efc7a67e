"""The decoder's small per-token steps fused into one Triton kernel each on GPU, where every kernel of a decode step
costs a launch: RMSNorm (seven torch kernels) and the rotary embedding of q and k (a dozen). The torch modules in
norm.py and rotary.py stay the reference and the CPU path. Imported only on GPU, or under TRITON_INTERPRET=1."""
import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x, weight, out, hidden, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    columns = tl.arange(0, BLOCK)
    mask = columns < hidden
    values = tl.load(x + row * stride_x + columns, mask=mask, other=0.0).to(tl.float32)
    normed = values * tl.rsqrt(tl.sum(values * values, 0) / hidden + eps)
    w = tl.load(weight + columns, mask=mask, other=0.0)
    tl.store(out + row * stride_out + columns, w * normed.to(w.dtype), mask=mask)  # rounded before the weight, as torch


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(flat)
    _rms_norm_kernel[(flat.shape[0],)](
        flat, weight, out, flat.shape[1], flat.stride(0), out.stride(0), eps, BLOCK=triton.next_power_of_2(flat.shape[1]),
    )
    return out.view(x.shape)


@triton.jit
def _rotary_kernel(
    states, out, cos, sin, positions, stride_token, stride_head, stride_out_token, stride_out_head, stride_table,
    HALF: tl.constexpr,
):
    """One (token, head): out = x cos + rotate_half(x) sin, with rotate_half(x) = (-x2, x1) for halves x1, x2."""
    token, head = tl.program_id(0), tl.program_id(1)
    dims = tl.arange(0, HALF)
    position = tl.load(positions + token)
    c = tl.load(cos + position * stride_table + dims).to(tl.float32)  # the tables repeat their first half
    s = tl.load(sin + position * stride_table + dims).to(tl.float32)
    base = states + token * stride_token + head * stride_head
    x1 = tl.load(base + dims).to(tl.float32)
    x2 = tl.load(base + HALF + dims).to(tl.float32)
    target = out + token * stride_out_token + head * stride_out_head
    tl.store(target + dims, (x1 * c - x2 * s).to(out.dtype.element_ty))
    tl.store(target + HALF + dims, (x2 * c + x1 * s).to(out.dtype.element_ty))


def rotary_triton(states: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, head_dim] (any strides along tokens and heads) rotated by each token's position."""
    tokens, heads, head_dim = states.shape
    out = torch.empty(tokens, heads, head_dim, dtype=states.dtype, device=states.device)
    _rotary_kernel[(tokens, heads)](
        states, out, cos, sin, positions, states.stride(0), states.stride(1), out.stride(0), out.stride(1), cos.stride(0),
        HALF=head_dim // 2,
    )
    return out
