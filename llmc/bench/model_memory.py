"""What a model holds in memory, as a benchmark reports it."""
import torch


def resident_bytes(model: torch.nn.Module, exclude: torch.Tensor | None = None) -> int:
    """Bytes of every tensor the model's modules hold (parameters, buffers, and tensors kept as plain attributes, such
    as the int4 kernels' dense copies), each storage once; `exclude` (the KV cache a runtime model holds) not counted."""
    storages = {} if exclude is None else {exclude.untyped_storage().data_ptr(): 0}
    for module in model.modules():
        for value in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            if not isinstance(value, torch.Tensor) or value.device.type == "meta":
                continue
            try:
                storage = value.untyped_storage()
                storages.setdefault(storage.data_ptr(), storage.nbytes())
            except NotImplementedError:  # oneDNN's packed (opaque) weights have no storage to share
                storages.setdefault(id(value), value.numel() * value.element_size())
    return sum(storages.values())
