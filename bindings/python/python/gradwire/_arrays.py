"""Conversions between the caller's arrays (numpy, or torch when installed) and the flat,
C-contiguous float32 numpy arrays the native module reads without copying."""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch when it is not loaded)."""
    mod = type(x).__module__
    return mod.startswith("torch") and hasattr(x, "detach")


def flat_f32(x: Any) -> Tuple[np.ndarray, Tuple[int, ...]]:
    """``(flat float32 C-contiguous view or copy, shape)`` of a numpy array or torch tensor.

    No copy for a C-contiguous float32 array (or a CPU torch tensor of that layout); other
    dtypes are converted to float32 as the reference's ``.to(torch.float32)`` does.
    """
    if is_torch(x):
        t = x.detach()
        if t.dtype != _torch().float32:
            t = t.to(_torch().float32)
        a = t.cpu().contiguous().numpy()
    else:
        a = np.asarray(x)
        if a.dtype.kind not in "fiub":
            raise ValueError(f"expected a numeric array, got dtype {a.dtype}")
    shape = tuple(int(d) for d in a.shape)
    flat = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
    return flat, shape


def _torch():
    import torch

    return torch


def like(template: Any, a: np.ndarray) -> Any:
    """``a`` as a torch tensor when ``template`` is one (sharing memory), else ``a``."""
    if template is not None and is_torch(template):
        return _torch().from_numpy(a)
    return a


def nbytes(x: Any) -> int:
    """Bytes of a tensor's data: ``numel * element_size`` for torch, ``nbytes`` for numpy."""
    if is_torch(x):
        return int(x.numel() * x.element_size())
    return int(np.asarray(x).nbytes)
