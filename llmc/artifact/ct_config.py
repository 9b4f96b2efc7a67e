"""A compressed-tensors `quantization_config` read back as llmc's formats. Plain dicts in, QuantArgs out: no
compressed-tensors import, so the runtime loads artifacts without the package."""
from llmc.quant.qtypes import QuantArgs


def from_ct_args(args: dict) -> QuantArgs:
    scale_dtype = args.get("scale_dtype")  # "torch.float8_e4m3fn", "torch.uint8"
    return QuantArgs(
        num_bits=args["num_bits"],
        type=args["type"],
        symmetric=args["symmetric"],
        strategy=args["strategy"],
        group_size=args.get("group_size"),
        block_structure=args.get("block_structure"),
        dynamic="local" if args.get("dynamic") == "local" else bool(args.get("dynamic")),
        actorder="static" if args.get("actorder") == "weight" else args.get("actorder"),
        observer="mse" if args.get("observer") == "mse" else "minmax",
        scale_dtype=scale_dtype.removeprefix("torch.") if scale_dtype and args["type"] == "float" else None,
    )


def schemes_from_config(quantization_config: dict) -> list[tuple[list[str], QuantArgs, QuantArgs | None]]:
    """(targets, weight args, input-activation args) per config group, for reading an artifact back."""
    return [
        (group["targets"], from_ct_args(group["weights"]),
         from_ct_args(group["input_activations"]) if group.get("input_activations") else None)
        for group in quantization_config["config_groups"].values()
    ]


def kv_cache_args_from_config(quantization_config: dict) -> QuantArgs | None:
    scheme = quantization_config.get("kv_cache_scheme")
    if not scheme:
        return None
    if scheme["strategy"] == "tensor_group":
        return from_ct_args(scheme)
    strategy = "channel" if scheme["strategy"] == "attn_head" else "tensor"
    return QuantArgs(num_bits=8, type=scheme["type"], strategy=strategy)
