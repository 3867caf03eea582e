"""Row gathers shared by the kernels."""

import torch

# index_select of floating rows, copied as integers of the same width: bitwise the same result, and
# several times faster on CPU for bfloat16 (torch 2.13, [2560, 512] rows: 0.40 -> 0.08 ms one thread)
_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, index)."""
    it = _SAME_WIDTH_INT.get(x.element_size())
    if it is None or not x.is_floating_point():
        return x.index_select(0, index)
    return x.view(it).index_select(0, index).view(x.dtype)
