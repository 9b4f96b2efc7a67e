"""AutoGPTQ / GPTQModel checkpoint layout, for loaders that predate compressed-tensors. Per Linear: `qweight`
int32 [in * b / 32, out] (unsigned codes packed along the input dim, row 8r + j of word r at bits 4j for int4),
`qzeros` int32 [groups, out * b / 32] (packed along the output dim; v1 `gptq` stores zero - 1, v2 `gptq_v2` the
exact zero), `scales` fp16 [groups, out], `g_idx` int32 [in]. Dequantize: (q - z) * scales[g_idx]."""
import torch

import llmc
from llmc.artifact.pack import pack_int32, unpack_int32
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.quant.qtypes import QuantArgs, QuantizedWeight


def zero_offset(checkpoint_format: str) -> int:
    return 1 if checkpoint_format == "gptq" else 0


def gptq_tensors(name: str, weight: QuantizedWeight, checkpoint_format: str) -> dict[str, torch.Tensor]:
    args = weight.args
    columns = weight.codes.shape[1]
    # llmc's signed codes and zero points shifted by 2^(b-1) are GPTQ's unsigned ones, which pack_int32 does
    zeros = weight.zero_point.t().to(torch.int16) - zero_offset(checkpoint_format)
    if weight.g_idx is not None:
        g_idx = weight.g_idx
    elif args.strategy == "group":
        g_idx = torch.arange(columns, dtype=torch.int32) // args.group_size
    else:
        g_idx = torch.zeros(columns, dtype=torch.int32)
    return {
        f"{name}.qweight": pack_int32(weight.codes, args.num_bits).t().contiguous(),
        f"{name}.qzeros": pack_int32(zeros, args.num_bits),
        f"{name}.scales": weight.scale.t().to(torch.float16).contiguous(),
        f"{name}.g_idx": g_idx.to(torch.int32),
    }


def read_gptq_weight(reader: CheckpointReader, name: str, args: QuantArgs, checkpoint_format: str) -> QuantizedWeight:
    scales = reader.tensor(f"{name}.scales")
    qweight = reader.tensor(f"{name}.qweight")
    columns = qweight.shape[0] * 32 // args.num_bits
    codes = unpack_int32(qweight.t().contiguous(), args.num_bits, columns)
    zeros = unpack_int32(reader.tensor(f"{name}.qzeros"), args.num_bits, scales.shape[1]) + zero_offset(checkpoint_format)
    g_idx = reader.tensor(f"{name}.g_idx") if args.actorder == "group" else None
    return QuantizedWeight(codes, scales.t().contiguous(), zeros.t().contiguous().to(torch.int8), args, g_idx)


def gptq_config(args: QuantArgs, checkpoint_format: str, dampening_frac: float | None) -> dict:
    return {
        "quant_method": "gptq",
        "bits": args.num_bits,
        "group_size": args.group_size if args.strategy == "group" else -1,
        "desc_act": args.actorder == "group",
        "sym": args.symmetric,
        "lm_head": False,
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
        "damp_percent": dampening_frac,
        "meta": {"quantizer": [f"llmc:{llmc.__version__}"]},
    }


def args_from_gptq_config(config: dict) -> QuantArgs:
    grouped = config["group_size"] != -1
    return QuantArgs(
        num_bits=config["bits"], symmetric=config["sym"], strategy="group" if grouped else "channel",
        group_size=config["group_size"] if grouped else None, actorder="group" if config.get("desc_act") else None,
    )
