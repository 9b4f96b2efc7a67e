"""A packed-weight CPU kernel's dequantized copy of its weights: its kernel multiplies row by row, its time growing with
the rows, so steps of more than `max_eager_rows` rows go on the copy (on oneDNN's GEMM where it packs the dtype), the
same weights several times faster from a dozen rows up, for 4x the 4-bit bytes in memory."""
import torch
import torch.nn.functional as F

from llmc.runtime.layers.onednn_packed import PackedWeight, packs_for_onednn


class DenseCopy:
    """The copy's holder, mixed into the kernel modules that keep one (linear.DENSE_COPY_KERNELS), whose __init__ calls
    no_dense_copy (instance attributes: a PackedWeight set later is a submodule, which a class attribute would hide)."""

    def no_dense_copy(self) -> None:
        self.dense: PackedWeight | torch.Tensor | None = None
        self.max_eager_rows = 0

    def keep_dense_copy(self, dense: torch.Tensor, max_eager_rows: int) -> None:
        self.dense = PackedWeight(dense, None) if packs_for_onednn(dense.dtype, "cpu") else dense
        self.max_eager_rows = max_eager_rows

    def dense_product(self, flat: torch.Tensor) -> torch.Tensor | None:
        """flat [rows, in] times the copy, for a step of more rows than max_eager_rows; None for the kernel to take."""
        if self.dense is None or len(flat) <= self.max_eager_rows:
            return None
        return self.dense(flat) if isinstance(self.dense, PackedWeight) else F.linear(flat, self.dense)
