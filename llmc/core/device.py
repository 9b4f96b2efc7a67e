"""The device a run computes on: `auto` (the first CUDA device when there is one, else the CPU), `cpu`, `cuda`,
`cuda:N`; and the peak memory a run used, host and device."""
import os
import re
import resource

import torch

from llmc.core.errors import LlmcError

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def resolve_device(name: str) -> torch.device:
    if not DEVICE_PATTERN.fullmatch(name):
        raise LlmcError(f"expected auto, cpu, cuda or cuda:N, got {name!r}")
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            reason = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise LlmcError(f"{name} asked for, but {reason}; use cpu (or auto)")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise LlmcError(f"{name} asked for, but only {torch.cuda.device_count()} CUDA device(s) are visible")
        device = torch.device("cuda", index)
    return device


def rank_device(device: torch.device) -> torch.device:
    """Under torchrun, each rank computes on its own CUDA device, cuda:LOCAL_RANK; the CPU stays the CPU."""
    if device.type != "cuda" or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise LlmcError(f"rank {local_rank} has no CUDA device of its own: {torch.cuda.device_count()} are visible")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return f"{device} ({properties.name}, {properties.total_memory / 2**30:.0f} GiB)"
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def peak_memory(device: torch.device) -> dict[str, float | None]:
    """GiB: the process's peak resident host memory, and the peak memory torch allocated on the device."""
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # ru_maxrss is in KiB on Linux
    on_device = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"peak_host_rss_gib": round(host, 3), "peak_device_gib": None if on_device is None else round(on_device, 3)}
