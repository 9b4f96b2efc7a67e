"""A quantized Linear as compressed-tensors tensors, and the `quantization_config` that tells transformers and vLLM
how to read them. Formats: `pack-quantized` (int weights, weight-only), `int-quantized` (int8 weights with
quantized activations, W8A8), `float-quantized` (FP8 weights); several in one model make `mixed-precision`."""
import compressed_tensors
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

from llmc.artifact.pack import pack_int32
from llmc.quant.qtypes import QuantArgs, QuantizedWeight

PACK_QUANTIZED, INT_QUANTIZED, FLOAT_QUANTIZED = "pack-quantized", "int-quantized", "float-quantized"
MIXED_PRECISION = "mixed-precision"


def ct_format(weights: QuantArgs, input_activations: QuantArgs | None) -> str:
    if weights.type == "float":
        return FLOAT_QUANTIZED
    return INT_QUANTIZED if input_activations is not None else PACK_QUANTIZED


def compressed_tensors_tensors(name: str, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
    args = weight.args
    tensors = {f"{name}.weight_scale": weight.scale.contiguous()}
    if ct_format(args, weight.input_activations) != PACK_QUANTIZED:
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
    return QuantizationArgs(
        num_bits=args.num_bits, type=args.type, symmetric=args.symmetric, strategy=args.strategy,
        group_size=args.group_size, actorder=args.actorder, dynamic=args.dynamic, observer=args.observer,
        block_structure=list(args.block_structure) if args.block_structure else None,
    )


def kv_cache_ct_args(args: QuantArgs) -> QuantizationArgs:
    strategy = "attn_head" if args.strategy == "channel" else "tensor"
    return QuantizationArgs(num_bits=8, type=args.type, symmetric=True, strategy=strategy, dynamic=False)


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
            targets=["Linear"] if single else sorted(names), weights=to_ct_args(args),
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
