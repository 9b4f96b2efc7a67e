"""A quantized Linear as compressed-tensors tensors, and the `quantization_config` that tells transformers and vLLM
how to read them. The format of each Linear is the one compressed-tensors itself infers for its scheme
(`infer_module_format`), except that W4A8 and W4AFP8 are packed as llm-compressor's docs save W4AFP8 for vLLM, whose
kernels for them read packed weights: `pack-quantized` (int weights below 8 bits, packed into int32),
`int-quantized` (int8 weights with quantized activations, W8A8, codes stored as int8), `float-quantized` (FP8),
`nvfp4-pack-quantized` and `mxfp4-pack-quantized` (float4 codes two per byte, with float8 or E8M0 group scales),
`mxfp8-quantized` (FP8 codes, E8M0 scales); several in one model make `mixed-precision`."""
import compressed_tensors
import torch
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

from llmc.artifact.pack import e8m0, pack_e2m1, pack_int32
from llmc.quant.qtypes import FP8_MAX, QuantArgs, QuantizedWeight

PACK_QUANTIZED, NVFP4_PACK_QUANTIZED, MXFP4_PACK_QUANTIZED = "pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized"
MIXED_PRECISION = "mixed-precision"
SCALE_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8}


def ct_format(weights: QuantArgs, input_activations: QuantArgs | None) -> str:
    if weights.type == "int" and weights.num_bits < 8:
        return PACK_QUANTIZED
    scheme = QuantizationScheme(
        targets=["Linear"], weights=to_ct_args(weights),
        input_activations=to_ct_args(input_activations) if input_activations else None,
    )
    return infer_module_format(torch.nn.Linear, scheme).value


def stored_scale(weight: QuantizedWeight) -> torch.Tensor:
    """The scale as the format stores it: E8M0 codes (MX), the float8 group scale times the global scale (NVFP4),
    else as it is (the model's dtype)."""
    if weight.args.is_mx:
        return e8m0(weight.scale)
    if weight.global_scale is not None:
        return (weight.scale.float() * weight.global_scale).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    return weight.scale


def compressed_tensors_tensors(name: str, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
    args = weight.args
    tensors = {f"{name}.weight_scale": stored_scale(weight).contiguous()}
    if weight.global_scale is not None:
        # a tensor of its own: Linears sharing a global scale share its storage, which safetensors refuses
        tensors[f"{name}.weight_global_scale"] = weight.global_scale.float().reshape(1).clone()
    fmt = ct_format(args, weight.input_activations)
    if fmt in (NVFP4_PACK_QUANTIZED, MXFP4_PACK_QUANTIZED):
        tensors[f"{name}.weight_packed"] = pack_e2m1(weight.codes)
        return tensors
    if fmt != PACK_QUANTIZED:  # int-quantized / float-quantized / mxfp8-quantized: codes stored as they are
        tensors[f"{name}.weight"] = weight.codes.contiguous()
        if not args.symmetric:
            tensors[f"{name}.weight_zero_point"] = weight.zero_point.contiguous()
        return tensors
    tensors[f"{name}.weight_packed"] = pack_int32(weight.codes, args.num_bits)
    tensors[f"{name}.weight_shape"] = torch.tensor(weight.codes.shape, dtype=torch.int64)
    if not args.symmetric:
        # zero points pack along the output dim: [ceil(out * b / 32), in / group_size]
        tensors[f"{name}.weight_zero_point"] = pack_int32(weight.zero_point.t(), args.num_bits).t().contiguous()
    return tensors


def to_ct_args(args: QuantArgs) -> QuantizationArgs:
    scale_dtype = SCALE_DTYPES.get(args.scale_dtype)
    return QuantizationArgs(
        num_bits=args.num_bits, type=args.type, symmetric=args.symmetric, strategy=args.strategy,
        group_size=args.group_size, actorder=args.actorder, dynamic=args.dynamic, observer=args.observer,
        block_structure=list(args.block_structure) if args.block_structure else None,
        scale_dtype=scale_dtype, zp_dtype=scale_dtype,
    )


def kv_cache_ct_args(args: QuantArgs) -> QuantizationArgs:
    if args.strategy == "tensor_group":  # NVFP4: the preset's input activation arguments, as compressed-tensors writes them
        return to_ct_args(args)
    strategy = "attn_head" if args.strategy == "channel" else "tensor"
    return QuantizationArgs(num_bits=8, type=args.type, symmetric=True, strategy=strategy, dynamic=False)


# a quantized LM head is named in its group's targets beside "Linear": vLLM matches "Linear" to its linear layers only,
# and would build its ParallelLMHead unquantized (then refuse the head's packed weights)
NAMED_TARGETS = ("lm_head",)


def quantization_config(
    quantized: dict[str, QuantArgs], all_linears: list[str], activations: dict[str, QuantArgs],
    kv_cache: QuantArgs | None = None,
) -> dict:
    """One config group per distinct (weights, input activations) format; every Linear left unquantized goes to
    `ignore`."""
    groups: dict[tuple, list[str]] = {}
    for name, args in quantized.items():
        groups.setdefault((args, activations.get(name)), []).append(name)
    ignore = sorted(name for name in all_linears if name not in quantized)
    single = len(groups) == 1
    config_groups = {
        f"group_{index}": QuantizationScheme(
            targets=["Linear", *sorted(set(names) & set(NAMED_TARGETS))] if single else sorted(names), weights=to_ct_args(args),
            input_activations=to_ct_args(acts) if acts else None, format=ct_format(args, acts),
        )
        for index, ((args, acts), names) in enumerate(groups.items())
    }
    formats = {group.format for group in config_groups.values()}
    fmt = MIXED_PRECISION if len(formats) > 1 else next(iter(formats), "dense")
    config = QuantizationConfig(
        config_groups=config_groups, format=fmt, quantization_status="compressed", ignore=ignore,
        kv_cache_scheme=kv_cache_ct_args(kv_cache) if kv_cache else None,
    ).model_dump()
    config.update(version=compressed_tensors.__version__, sparsity_config={}, transform_config={})
    return config
