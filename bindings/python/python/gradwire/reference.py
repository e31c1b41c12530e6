"""A drop-in for the reference Python compression module (top-k, optional int8, error feedback).

``import gradwire.reference as compression`` in place of the reference module gives the same
functions with the same signatures: :func:`compress` returns the same payload keys
(``NAME::idx`` int64, ``NAME::val`` float32 or int8, ``NAME::scale`` float32 of shape ``[1]``),
dtypes, shapes and kept entries, and updates ``residual`` in place the same way;
:func:`decompress` rebuilds the same dense tensors. Inputs may be numpy arrays or torch
tensors; outputs are of the same kind as the inputs (torch in, torch out).

Where gradwire differs, on purpose:

* **int8 residuals keep the rounding error.** With ``mode="topk-int8"`` the reference sets the
  residual to zero at the kept entries, losing each value's int8 rounding error; gradwire
  leaves ``x - code * scale`` there (``x`` = gradient + old residual), so over steps nothing is
  lost. The payload itself is the reference's for the same input.
* **Kept entries in ascending index order** (the reference writes them in no particular
  order; its decoder, and this one, accept any order).
* **Hostile payloads are refused, never half-decoded.** :func:`decompress` checks every key
  (one missing or one unexpected: :class:`gradwire.PayloadError`), dtype, shape, index (in
  range, each once), value (finite), int8 code (in ``[-127, 127]``) and scale (finite, > 0)
  before writing anything. Where the reference's reader is looser:

  - int32 (or other integer) indices: accepted, widened to int64, then checked;
  - a scale of shape ``[]``: accepted as ``[1]``;
  - float16 or bfloat16 values: refused (:class:`gradwire.PayloadError`); the layout's values
    are float32 or int8;
  - keys of tensors not in ``shapes``: refused (the reference ignores them).
* **NaN or Inf** in a gradient (or in gradient + residual) raises ``ValueError`` naming the
  tensor and position, and nothing changes (the reference would send it).
* ``topk_count(0, ratio)`` is 0 (the reference's 1 cannot be kept from an empty tensor).

The work runs in Rust with the GIL released.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from ._arrays import flat_f32, is_torch, like, nbytes

IDX = "::idx"
VAL = "::val"
SCALE = "::scale"

NONE = "none"
TOPK = "topk"
TOPK_INT8 = "topk-int8"
MODES = (NONE, TOPK, TOPK_INT8)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown compression mode {mode!r}; expected one of {MODES}")


def topk_count(numel: int, ratio: float) -> int:
    """How many entries survive top-k for a tensor of ``numel`` elements:
    ``max(1, min(numel, floor(numel * ratio)))``, ``numel`` for ``ratio >= 1``, 0 for an empty
    tensor."""
    return int(_native.topk_count(int(numel), float(ratio)))


def compress(
    tensors: Mapping[str, Any],
    mode: str = TOPK,
    ratio: float = 0.01,
    residual: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Compresses ``{name: dense_gradient}`` into a sparse wire payload.

    ``residual`` (error feedback) is read and updated in place when given: for each tensor the
    input is ``gradient + residual[name]`` (a missing name counts as zeros), and afterwards
    ``residual[name]`` holds what was not sent, with the gradient's shape. All or nothing: on an
    error no residual changes.

    Raises ``ValueError`` for an unknown mode, a NaN, infinite or negative ratio, a tensor name
    containing ``::``, NaN or Inf in a gradient, or a residual whose element count differs from
    its gradient's.
    """
    _check_mode(mode)
    if mode == NONE:
        return dict(tensors)
    names = list(tensors.keys())
    inputs = []
    for name in names:
        flat, shape = flat_f32(tensors[name])
        inputs.append((str(name), list(shape), flat))
    residuals = None
    if residual is not None:
        residuals = []
        for name in names:
            prev = residual.get(name)
            residuals.append(None if prev is None else flat_f32(prev)[0])
    entries, new_residuals = _native.reference_compress(inputs, mode, float(ratio), residuals)
    out: Dict[str, Any] = {}
    for name, (_, idx, val, scale) in zip(names, entries):
        template = tensors[name]
        out[name + VAL] = like(template, val)
        if scale is not None:
            out[name + SCALE] = like(template, np.array([scale], dtype=np.float32))
        out[name + IDX] = like(template, idx)
    if residual is not None:
        for name, (_, shape, _), r in zip(names, inputs, new_residuals):
            residual[name] = like(tensors[name], r.reshape(shape))
    return out


def _array_of(x: Any) -> np.ndarray:
    if is_torch(x):
        return x.detach().cpu().contiguous().numpy()
    return np.asarray(x)


def _payload_tensors(payload: Mapping[str, Any]):
    packed = []
    for key, value in payload.items():
        a = _array_of(value)
        if key.endswith(IDX) and a.dtype.kind in "iu" and a.dtype != np.int64:
            if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
                raise _native.PayloadError(f"key {key!r}: an index does not fit an int64")
            a = a.astype(np.int64)
        if key.endswith(SCALE) and a.shape == ():
            a = a.reshape(1)
        dtype = a.dtype.name
        if dtype not in ("int64", "float32", "int8"):
            raise _native.PayloadError(
                f"key {key!r} has dtype {dtype}: the reference layout has int64 indices, "
                "float32 or int8 values and float32 scales"
            )
        a = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False)
        packed.append((str(key), dtype, [int(d) for d in a.shape], a.tobytes()))
    return packed


def to_bytes(payload: Mapping[str, Any]) -> bytes:
    """The payload as one safetensors file, the bytes the reference sends over HTTP."""
    return _native.reference_pack(_payload_tensors(payload))


def decompress(
    payload: Union[Mapping[str, Any], bytes],
    shapes: Mapping[str, Sequence[int]],
    mode: str = TOPK,
) -> Dict[str, Any]:
    """Rebuilds dense float32 gradients from a sparse payload (a ``{key: tensor}`` mapping, or
    its safetensors bytes), one per name of ``shapes`` (the receiver's own model: shapes never
    travel). Torch tensors in the payload give torch tensors out.

    Raises :class:`gradwire.PayloadError` for a payload that fails any check (see the module
    docs), ``ValueError`` for an unknown mode.
    """
    _check_mode(mode)
    if mode == NONE:
        if isinstance(payload, (bytes, bytearray, memoryview)):
            raise ValueError("mode none: the payload is the dense tensors themselves")
        return dict(payload)
    if isinstance(payload, (bytes, bytearray, memoryview)):
        raw = bytes(payload)
        torch_out = False
    else:
        raw = to_bytes(payload)
        torch_out = any(is_torch(v) for v in payload.values())
    names = list(shapes.keys())
    specs = [(str(n), [int(d) for d in shapes[n]]) for n in names]
    dense = _native.reference_decode(raw, mode, specs)
    out: Dict[str, Any] = {}
    for (name, shape), flat in zip(specs, dense):
        a = flat.reshape(shape)
        if torch_out:
            import torch

            a = torch.from_numpy(a)
        out[name] = a
    return out


def payload_bytes(payload: Mapping[str, Any]) -> int:
    """Total tensor bytes in a payload (excludes safetensors' small header)."""
    return sum(nbytes(t) for t in payload.values())


def compression_report(dense: Mapping[str, Any], wire: Mapping[str, Any]) -> Tuple[int, int, float]:
    """``(dense_bytes, wire_bytes, ratio)``: ratio is how many times smaller the wire is."""
    d = payload_bytes(dense)
    w = payload_bytes(wire)
    return d, w, (d / w if w else 1.0)
