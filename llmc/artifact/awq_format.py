"""AutoAWQ GEMM checkpoint layout (int4 only). Per Linear: `qweight` int32 [in, out / 8] and `qzeros` int32
[groups, out / 8], both packed along the output dim with nibble i of word c holding output column
8c + AWQ_ORDER[i], zeros stored exactly; `scales` fp16 [groups, out]. Dequantize: (q - z) * s."""
import torch

from llmc.artifact.pack import pack_int32, unpack_int32
from llmc.checkpoints.checkpoint_reader import CheckpointReader
from llmc.quant.qtypes import QuantArgs, QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_BITS = 4


def interleave(columns: int) -> torch.Tensor:
    """Column index for each packed position: position 8c + i holds column 8c + AWQ_ORDER[i]."""
    return torch.arange(columns).reshape(-1, 8)[:, list(AWQ_ORDER)].reshape(-1)


def awq_tensors(name: str, weight: QuantizedWeight) -> dict[str, torch.Tensor]:
    order = interleave(weight.codes.shape[0])
    return {
        f"{name}.qweight": pack_int32(weight.codes.t()[:, order], AWQ_BITS),
        f"{name}.qzeros": pack_int32(weight.zero_point.t()[:, order], AWQ_BITS),
        f"{name}.scales": weight.scale.t().to(torch.float16).contiguous(),
    }


def read_awq_weight(reader: CheckpointReader, name: str, args: QuantArgs) -> QuantizedWeight:
    scales = reader.tensor(f"{name}.scales")
    restore = torch.argsort(interleave(scales.shape[1]))
    codes = unpack_int32(reader.tensor(f"{name}.qweight"), AWQ_BITS, scales.shape[1])[:, restore]
    zeros = unpack_int32(reader.tensor(f"{name}.qzeros"), AWQ_BITS, scales.shape[1])[:, restore]
    return QuantizedWeight(codes.t().contiguous(), scales.t().contiguous(), zeros.t().contiguous(), args)


def awq_config(args: QuantArgs) -> dict:
    # GEMM kernels always read qzeros, so zero_point is true even for a symmetric grid (whose zeros are all 8)
    return {"quant_method": "awq", "zero_point": True, "group_size": args.group_size, "bits": AWQ_BITS, "version": "gemm",
            "modules_to_not_convert": None}


def args_from_awq_config(config: dict) -> QuantArgs:
    # zeros are explicit, so reading back as asymmetric is exact either way
    return QuantArgs(num_bits=config["bits"], symmetric=False, strategy="group", group_size=config["group_size"])
