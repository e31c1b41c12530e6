"""Conversions between the caller's arrays (numpy, or torch when installed) and the flat,
C-contiguous float32 numpy arrays the native module reads without copying."""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

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


def in_place_f32(
    x: Any, device_copy: bool = False
) -> Tuple[np.ndarray, Tuple[int, ...], Optional[Callable[[], None]]]:
    """``(flat float32 array, shape, write_back)`` for a step that overwrites ``x`` with its result.

    A C-contiguous, writable float32 numpy array, or a contiguous float32 CPU torch tensor, is
    used where it is (``write_back`` is ``None``: no copy). Any other dtype (float16, bfloat16,
    float64) or a non-contiguous layout costs one documented copy: the values are converted
    into a float32 buffer, and ``write_back`` copies the result back into ``x`` (rounded to its
    dtype). A tensor on another device is a ``TypeError`` naming the copy to make (``.cpu()``),
    or with ``device_copy`` (the torch helpers) one copy to the CPU and one back; anything else
    but a numpy array or a torch tensor is a ``TypeError`` (there is no memory to write into).
    """
    if is_torch(x):
        torch = _torch()
        t = x.detach()
        if t.device.type != "cpu" and device_copy:
            work = t.to("cpu", torch.float32, copy=True).contiguous().view(-1)
            return work.numpy(), tuple(int(d) for d in t.shape), lambda: t.copy_(work.view(t.shape))
        if t.device.type != "cpu":
            raise TypeError(
                f"a {t.device.type} tensor: all_reduce_ reads and writes CPU memory; pass "
                "t.cpu() and copy the result back (t.copy_(cpu_tensor))"
            )
        shape = tuple(int(d) for d in t.shape)
        if t.dtype == torch.float32 and t.is_contiguous():
            return t.view(-1).numpy(), shape, None
        work = t.to(torch.float32, copy=True).contiguous().view(-1)
        return work.numpy(), shape, lambda: t.copy_(work.view(t.shape))
    if not isinstance(x, np.ndarray):
        raise TypeError(
            f"all_reduce_ writes its result into numpy arrays or torch tensors, got "
            f"{type(x).__name__}"
        )
    if not x.flags.writeable:
        raise ValueError("all_reduce_ writes its result into the array, which is read-only")
    shape = tuple(int(d) for d in x.shape)
    if x.dtype == np.float32 and x.flags.c_contiguous:
        return x.reshape(-1), shape, None
    if x.dtype.kind not in "fiub":
        raise ValueError(f"expected a numeric array, got dtype {x.dtype}")
    work = np.array(x, dtype=np.float32, order="C").reshape(-1)
    return work, shape, lambda: np.copyto(x, work.reshape(shape), casting="unsafe")


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
