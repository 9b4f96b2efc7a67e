"""Data-parallel calibration (`llmc quantize --nproc N`, or under torchrun): each rank holds a contiguous share of
the calibration samples and runs every layer over it; the stages' statistics are summed (or maxed) across ranks
before they are used, each GPTQ solve runs on one rank and its result is broadcast, so every rank ends each layer
with the same weights. torch.distributed: NCCL across CUDA devices, gloo on CPU. One process is world size 1,
where every collective is a no-op."""
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
                                          torch.int32, torch.int64, torch.uint8, torch.float8_e4m3fn)}


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")  # where collectives run: the rank's CUDA device (NCCL) or the CPU (gloo)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def samples(self, num_samples: int) -> slice:
        """This rank's contiguous share of the samples: in rank order, the shares are the whole set in order."""
        bounds = [num_samples * rank // self.world_size for rank in range(self.world_size + 1)]
        return slice(bounds[self.rank], bounds[self.rank + 1])

    def owner(self, index: int) -> int:
        """The rank that does the index-th piece of work everyone else waits for."""
        return index % self.world_size

    def _reduce(self, tensor: torch.Tensor, op) -> torch.Tensor:
        if not self.distributed:
            return tensor
        moved = tensor.to(self.device)
        dist.all_reduce(moved, op=op)
        return moved.to(tensor.device)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, dist.ReduceOp.SUM)

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, dist.ReduceOp.MAX)

    def sum_floats(self, *values: float) -> list[float]:
        return self.sum(torch.tensor(values, dtype=torch.float64)).tolist()

    def _row_counts(self, num_rows: int) -> list[int]:
        """Every rank's number of rows, in rank order."""
        counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(counts, torch.tensor([num_rows], device=self.device))
        return [int(count) for count in counts]

    def row_offset(self, num_rows: int) -> tuple[int, int]:
        """Where this rank's rows start among all ranks' rows in rank order, and how many there are in all."""
        if not self.distributed:
            return 0, num_rows
        counts = self._row_counts(num_rows)
        return sum(counts[: self.rank]), sum(counts)

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's rows (as many as each has), concatenated in rank order."""
        if not self.distributed:
            return rows
        counts = self._row_counts(len(rows))
        padded = torch.zeros(max(counts), *rows.shape[1:], dtype=rows.dtype, device=self.device)
        padded[: len(rows)] = rows
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        return torch.cat([part[:count] for part, count in zip(gathered, counts)]).to(rows.device)

    def broadcast_tensors(self, tensors: dict[str, torch.Tensor] | None, src: int, device: torch.device) -> dict[str, torch.Tensor]:
        """src's tensors on every rank (on device): their names, shapes and dtypes go first, as JSON bytes."""
        if not self.distributed:
            return tensors
        header = json.dumps({name: [list(t.shape), str(t.dtype)] for name, t in tensors.items()}) if self.rank == src else ""
        length = torch.tensor([len(header)], dtype=torch.int64, device=self.device)
        dist.broadcast(length, src)
        encoded = torch.zeros(int(length), dtype=torch.uint8, device=self.device)
        if self.rank == src:
            encoded.copy_(torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8))
        dist.broadcast(encoded, src)
        layout = json.loads(bytes(encoded.cpu().tolist()).decode())
        received = {}
        for name, (shape, dtype) in layout.items():
            buffer = tensors[name].to(self.device) if self.rank == src else torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
            carried = buffer.view(torch.uint8) if buffer.dtype == torch.float8_e4m3fn else buffer  # NCCL/gloo lack fp8
            dist.broadcast(carried, src)
            received[name] = buffer.to(device)
        return received


SINGLE = Ranks()


def ranks_from_environment(device: torch.device) -> Ranks:
    """Under torchrun (WORLD_SIZE set): join the process group, NCCL on CUDA, gloo on CPU; else one process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return SINGLE
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Ranks(dist.get_rank(), world_size, device if device.type == "cuda" else torch.device("cpu"))
