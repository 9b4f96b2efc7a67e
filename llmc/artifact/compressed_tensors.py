"""A quantized Linear as compressed-tensors `pack-quantized` tensors, and the `quantization_config` that tells
transformers and vLLM how to read them."""
import compressed_tensors
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

from llmc.artifact.pack import pack_int32
from llmc.quant.qtypes import QuantArgs, QuantizedWeight

PACK_QUANTIZED = "pack-quantized"


def pack_quantized_tensors(name: str, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
    args = weight.args
    tensors = {
        f"{name}.weight_packed": pack_int32(weight.codes, args.num_bits),
        f"{name}.weight_scale": weight.scale.contiguous(),
        f"{name}.weight_shape": torch.tensor(weight.codes.shape, dtype=torch.int64),
    }
    if not args.symmetric:
        # zero points pack along the output dim: [ceil(out * b / 32), in / group_size]
        tensors[f"{name}.weight_zero_point"] = pack_int32(weight.zero_point.t(), args.num_bits).t().contiguous()
    return tensors


def to_ct_args(args: QuantArgs) -> QuantizationArgs:
    return QuantizationArgs(
        num_bits=args.num_bits, type=args.type, symmetric=args.symmetric, strategy=args.strategy,
        group_size=args.group_size, actorder=args.actorder,
    )


def quantization_config(quantized: dict[str, QuantArgs], all_linears: list[str]) -> dict:
    """One config group per distinct weight format; everything Linear left unquantized goes to `ignore`."""
    groups: dict[QuantArgs, list[str]] = {}
    for name, args in quantized.items():
        groups.setdefault(args, []).append(name)
    ignore = sorted(name for name in all_linears if name not in quantized)
    single = len(groups) == 1
    config_groups = {
        f"group_{index}": QuantizationScheme(
            targets=["Linear"] if single else sorted(names), weights=to_ct_args(args), format=PACK_QUANTIZED
        )
        for index, (args, names) in enumerate(groups.items())
    }
    config = QuantizationConfig(
        config_groups=config_groups, format=PACK_QUANTIZED, quantization_status="compressed", ignore=ignore
    ).model_dump()
    config.update(version=compressed_tensors.__version__, sparsity_config={}, transform_config={})
    return config


def weight_args_from_config(quantization_config: dict) -> list[tuple[list[str], QuantArgs]]:
    """(targets, args) per config group, for reading an artifact back."""
    result = []
    for group in quantization_config["config_groups"].values():
        weights = group["weights"]
        args = QuantArgs(
            num_bits=weights["num_bits"],
            type=weights["type"],
            symmetric=weights["symmetric"],
            strategy=weights["strategy"],
            group_size=weights.get("group_size"),
            actorder="static" if weights.get("actorder") == "weight" else weights.get("actorder"),
        )
        result.append((group["targets"], args))
    return result
