"""gradwire: gradient compression for data-parallel training over slow links.

- :mod:`gradwire.reference`: a drop-in for the reference Python compression module (top-k,
  optional int8, error feedback) on numpy arrays or torch tensors.
- :class:`AllReduce`: the library's compressed all-reduce over a transport of raw byte
  collectives (:mod:`gradwire.comm`: ``torch.distributed``, ``mpi4py``), with its rules: every
  rank returns the same error at the same call, size limits are collective, the results are
  bit-identical on every rank; :mod:`gradwire.torch` builds a DDP comm hook on it.
- :class:`Compressor`: one rank's compressor for every method of the library (top-k, random-k,
  threshold, n-bit quantization, sign, f16/bf16 casts; error feedback keyed by parameter name),
  writing one versioned, checksummed bundle per step, with rank-order aggregation of the
  bundles of every rank and residual checkpoints.

Errors: ``ValueError`` for unusable input of the caller's own (NaN or Inf in a gradient, an
unknown method, a model that changed shape); :class:`PayloadError` for invalid bytes from
elsewhere (a peer's bundle, a payload, a checkpoint file); ``OSError`` for files;
``MemoryError`` for a model larger than memory where the library allocates it;
:class:`GradwireError` (the base of :class:`PayloadError`) for anything else.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from . import _native
from ._arrays import flat_f32, in_place_f32
from ._native import GradwireError, PayloadError

__all__ = [
    "AllReduce",
    "Compressor",
    "GradwireError",
    "PayloadError",
    "PendingAllReduce",
    "comm",
    "reference",
    "__version__",
]
__version__: str = _native.__version__

from . import comm, reference  # noqa: E402  (after the names they import from this package)


class Compressor:
    """One rank's compressor: ``method`` in the library's canonical text form, for example
    ``"topk k=ratio:0.01 values=int8:256"``, ``"randomk k=ratio:0.01 values=f32"``,
    ``"sign scale=mean-abs:1024"``, ``"quant bits=4 block=512 rounding=nearest-even"`` or
    ``"dense values=f16"`` (the text a checkpoint records and ``gradwire`` error messages
    print).

    ``error_feedback`` keeps, per parameter name, what a step did not send and adds it to the
    next step (refused for methods whose residual would grow without bound: unscaled sign,
    unbiased random-k). ``seed`` keys random-k draws and stochastic rounding: every rank of a
    job must use the same. ``shapes`` (``{name: shape}``) fixes the model up front; otherwise
    the first :meth:`compress` does, and later calls must give the same names and shapes.

    Arrays in are numpy arrays or torch tensors (converted to float32, then copied once into
    the library's tensors); arrays out are float32 numpy arrays, or torch tensors when
    ``as_torch=True``.
    """

    def __init__(
        self,
        method: str,
        error_feedback: bool = True,
        seed: int = 0,
        shapes: Optional[Mapping[str, Sequence[int]]] = None,
    ) -> None:
        spec = None
        if shapes is not None:
            spec = [(str(n), [int(d) for d in s]) for n, s in shapes.items()]
        self._inner = _native.Compressor(method, error_feedback, int(seed), spec)

    @property
    def method(self) -> str:
        """The method's canonical text (without error feedback)."""
        return self._inner.method

    @property
    def error_feedback(self) -> bool:
        """Whether residuals are kept."""
        return self._inner.error_feedback

    @property
    def seed(self) -> int:
        """Seed of random-k draws and stochastic rounding."""
        return self._inner.seed

    @property
    def step(self) -> int:
        """The step the next bundle is made at (starts at 0, one per :meth:`compress`)."""
        return self._inner.step

    @property
    def shapes(self) -> Optional[Dict[str, Tuple[int, ...]]]:
        """The model (``{name: shape}`` in bundle order), or ``None`` before it is fixed."""
        s = self._inner.shapes
        return None if s is None else {n: tuple(shape) for n, shape in s}

    @property
    def dense_bytes(self) -> int:
        """Bytes of the model's gradient as float32."""
        return self._inner.dense_bytes

    @property
    def last_bundle_bytes(self) -> int:
        """Bytes of the last bundle made (0 before the first)."""
        return self._inner.last_bundle_bytes

    def compress(self, gradients: Mapping[str, Any], rank: int = 0) -> bytes:
        """Compresses ``{name: gradient}`` into one bundle for ``rank``; the step advances.

        Raises ``ValueError`` for NaN or Inf (naming the tensor and index), a model that differs
        from the fixed one, or a value out of a cast's range; on an error nothing changes.
        """
        tensors = []
        for name, g in gradients.items():
            flat, shape = flat_f32(g)
            tensors.append((str(name), list(shape), flat))
        return self._inner.compress(tensors, int(rank))

    def decompress(self, bundle: bytes, rank: Optional[int] = None, as_torch: bool = False) -> Dict[str, Any]:
        """Decodes one bundle (this compressor's or a peer's: same method, seed and model) into
        ``{name: float32 array}``. ``rank``, when given, must be the bundle's.

        Raises :class:`PayloadError` for a bundle that fails any check (checksum, header,
        model, frame).
        """
        return _shaped(self._inner.decompress(_bytes_of(bundle), rank), as_torch)

    def aggregate(
        self, bundles: Sequence[bytes], reduction: str = "mean", as_torch: bool = False
    ) -> Dict[str, Any]:
        """Reduces every rank's bundle of one step (``bundles[r]`` is rank ``r``'s) into
        ``{name: float32 array}``: ``"mean"``, ``"sum"`` (in rank order: bit-identical on every
        rank holding the same bundles) or ``"majority-vote"`` (sign methods).

        Raises :class:`PayloadError` when a bundle fails a check, is another rank's than its
        position says, or is of another step than the first.
        """
        return _shaped(self._inner.aggregate([_bytes_of(b) for b in bundles], reduction), as_torch)

    def residuals(self, as_torch: bool = False) -> Dict[str, Any]:
        """A copy of every residual (``{name: float32 array}`` with the gradient's shape): what
        the steps so far have not sent yet. Empty without error feedback."""
        return _shaped(self._inner.residuals(), as_torch)

    def save(self, path: Any) -> None:
        """Writes the residual checkpoint (residuals with their shapes, step, seed, method) to
        ``path``. Raises ``ValueError`` when the method keeps no residuals, ``OSError`` when the
        file cannot be written."""
        self._inner.save(_path_of(path))

    def load(self, path: Any) -> None:
        """Restores a checkpoint written by :meth:`save` with the same method and seed; the
        step resumes from it. Raises :class:`PayloadError` for a file that is damaged or for
        another setup, ``OSError`` when it cannot be read, ``MemoryError`` for residuals larger
        than memory."""
        self._inner.load(_path_of(path))

    def __repr__(self) -> str:
        ef = ", error_feedback=True" if self.error_feedback else ""
        return f"Compressor({self.method!r}{ef}, seed={self.seed})"


class AllReduce:
    """One rank's compressed all-reduce over ``communicator`` (a transport of
    :mod:`gradwire.comm`, or any object with its two raw collectives).

    Every rank calls :meth:`all_reduce` with the same names and shapes, in the same order of
    calls. ``method`` and ``error_feedback`` as for :class:`Compressor`; ``seed`` must be the same
    on every rank; ``collective``: ``"allgather"`` (every rank's bundle to every rank),
    ``"two-phase"`` (shard owners reduce and re-compress: bytes per link flat as the world
    grows; top-k, sign, quantization and casts) or ``"auto"`` (whichever moves fewer bytes for
    this model and world size); ``reduction``: ``"mean"``, ``"sum"`` or ``"majority-vote"``.
    Uncompressed float32 (``"dense values=f32"``) goes through the rank-order dense sum, never
    an all-gather.

    ``skip_non_finite`` (mixed precision; every rank alike; off unless given, and on by default
    in :class:`gradwire.torch.HookState` when not given here): a step in which some rank's gradient
    holds NaN or an infinity (or, without error feedback, a value beyond the method's value
    type) is skipped on every rank instead of raising: every result is NaN, no residual changes
    and :attr:`step` does not advance (:attr:`last_step_skipped` tells), so that a loss scaler
    such as ``torch.amp.GradScaler`` skips the optimizer step and lowers its scale. Residuals
    hold gradients in the loss scale's units: :meth:`scale_residuals` follows a change of the
    scale (:class:`gradwire.torch.HookState` does both).

    Errors: a rank whose own step fails (NaN, another model) raises its ``ValueError`` and every
    peer a :class:`GradwireError` naming it, at the same call; ranks configured otherwise fail
    alike naming the field; no rank waits past the transport's deadline. The step advances on
    every rank either way, so the group can go on. A transport failure (a raw call that raises,
    a timeout) is different: the rank's communicator is closed and every later call raises
    ``GradwireError`` "the group is broken: ..." without calling the transport; recovery needs a
    new process group and ``AllReduce``, resumed from checkpoints.
    """

    def __init__(
        self,
        method: str,
        communicator: Any,
        error_feedback: bool = True,
        seed: int = 0,
        collective: str = "allgather",
        reduction: str = "mean",
        skip_non_finite: Optional[bool] = None,
    ) -> None:
        self._inner = _native.AllReduce(
            method,
            communicator,
            error_feedback,
            int(seed),
            collective,
            reduction,
            bool(skip_non_finite),
        )
        self._skip_non_finite = bool(skip_non_finite)
        # Whether the caller chose (the DDP hook's default does not override a choice).
        self._skip_chosen = skip_non_finite is not None
        self.communicator = communicator
        self.collective = collective

    @property
    def rank(self) -> int:
        """This rank."""
        return self._inner.rank

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._inner.world_size

    @property
    def step(self) -> int:
        """The step the next call runs at."""
        return self._inner.step

    @property
    def traffic(self) -> Tuple[int, int]:
        """``(sent, received)``: bytes this rank's calls addressed to peers and received from
        them so far (logical bytes, the same on every transport; each call adds its length
        exchange of 16 bytes per peer each way)."""
        return self._inner.traffic

    @property
    def last_step_seconds(self) -> float:
        """Wall time of the library's own last step, in seconds (the Rust call alone: without
        this module's conversions and copies; a Python transport's calls are inside it)."""
        return self._inner.last_step_seconds

    @property
    def skip_non_finite(self) -> bool:
        """Whether a step with a non-finite gradient on some rank is skipped (see the class);
        set it between steps, to the same value on every rank."""
        return self._skip_non_finite

    @skip_non_finite.setter
    def skip_non_finite(self, skip: bool) -> None:
        self._inner.set_skip_non_finite(bool(skip))
        self._skip_non_finite = bool(skip)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped for a non-finite gradient on some rank."""
        return self._inner.last_step_skipped

    def scale_residuals(self, factor: float) -> None:
        """Multiplies every residual (the worker's and the server residuals) by ``factor``:
        after a loss scale changed from ``old`` to ``new``, ``new / old`` (exact for a power of
        two). Every rank alike, between the same steps. ``ValueError`` for a factor that is not
        finite and positive, or that would overflow a residual (nothing changes then)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"factor must be a number, not {type(factor).__name__}")
        self._inner.scale_residuals(float(factor))

    @property
    def last_message_bytes(self) -> int:
        """Bytes of this rank's message in the last step (its bundle, or its shard messages)."""
        return self._inner.last_message_bytes

    @property
    def collective_in_use(self) -> Optional[str]:
        """``"allgather"`` or ``"two-phase"``: what the last step ran (``None`` before one)."""
        return self._inner.collective_in_use

    def all_reduce(self, gradients: Mapping[str, Any], as_torch: bool = False) -> Dict[str, Any]:
        """One step: ``{name: gradient}`` compressed, exchanged and reduced; returns
        ``{name: float32 array}``, bit-identical on every rank."""
        tensors = []
        for name, g in gradients.items():
            flat, shape = flat_f32(g)
            tensors.append((str(name), list(shape), flat))
        return _shaped(self._inner.all_reduce(tensors), as_torch)

    __call__ = all_reduce

    def all_reduce_(self, gradients: Mapping[str, Any]) -> None:
        """One step in place: each gradient's values are overwritten with the result (the
        mean, or the configured reduction), bit-identical on every rank and to
        :meth:`all_reduce`'s, with no copy of the model for C-contiguous float32 numpy arrays
        and contiguous float32 CPU torch tensors (the GIL is released while the step runs).
        Other dtypes and layouts cost one copy in and one back (see ``_arrays.in_place_f32``);
        a CUDA tensor is a ``TypeError`` (copy it to the CPU first). After an error the values
        are unspecified (the residuals keep the step's gradient, as for :meth:`all_reduce`)."""
        self._all_reduce_in_place(gradients, device_copy=False)

    def _all_reduce_in_place(self, gradients: Mapping[str, Any], device_copy: bool) -> None:
        """:meth:`all_reduce_`; with ``device_copy``, tensors on another device (CUDA) go
        through one copy to the CPU and back (the torch helpers' way)."""
        tensors, write_backs = _in_place_tensors(gradients, device_copy)
        self._inner.all_reduce_(tensors)
        for write_back in write_backs:
            write_back()

    def start_(self, gradients: Mapping[str, Any], ends_step: bool = True) -> "PendingAllReduce":
        """Starts a step in place without waiting for it: returns a :class:`PendingAllReduce`
        whose :meth:`~PendingAllReduce.wait` writes the results into ``gradients`` (the values
        :meth:`all_reduce_` would write, bit for bit). The step runs on a thread of the
        library's own (the Rust ``NonBlockingAllReduce``, at most 64 steps in flight; a 65th
        ``start_`` waits), so the caller computes meanwhile: the next bucket's gradients, the
        next micro-batch. The values are copied in at the call (a gradient may change after
        it) and copied back at ``wait``: two copies of what the step carries, where
        :meth:`all_reduce_` makes none. The copy in goes into the buffer of the last step
        waited for under the same name and length (kept by this ``AllReduce`` after ``wait``:
        up to one float32 copy of what its steps carry, held between steps), so that a
        training loop's steps reuse memory instead of allocating it afresh.

        ``ends_step``: ``False`` for every bucket of a model step but the last, so that the
        buckets of one step carry its step number and :attr:`step` advances once per model
        step (as DDP's ``bucket.is_last()`` says); ``True`` for a whole model. Every rank
        starts the same steps in the same order. The transport is called from the library's
        thread (with the GIL) while steps are in flight: give this ``AllReduce`` a process
        group of its own (``torch.distributed.new_group``), which no other thread uses at the
        same time. Every other method and property that reaches the library's state (steps,
        checkpoints, :attr:`step`, :attr:`traffic`, message sizes) first waits for the steps in
        flight."""
        return self._start_in_place(gradients, ends_step, device_copy=False)

    def _start_in_place(
        self, gradients: Mapping[str, Any], ends_step: bool, device_copy: bool
    ) -> "PendingAllReduce":
        """:meth:`start_`; with ``device_copy``, tensors on another device (CUDA) go through
        one copy to the CPU and back (the torch helpers' way)."""
        tensors, write_backs = _in_place_tensors(gradients, device_copy)
        return PendingAllReduce(self._inner.start_(tensors, bool(ends_step)), write_backs)

    def save(self, path: Any) -> None:
        """Writes this rank's residual checkpoint (as :meth:`Compressor.save`)."""
        self._inner.save(_path_of(path))

    def load(self, path: Any) -> None:
        """Restores this rank's residual checkpoint (same method and seed)."""
        self._inner.load(_path_of(path))

    def save_server_residuals(self, path: Any) -> None:
        """Writes this rank's server residuals (two-phase: what it owns and has not sent)."""
        self._inner.save_server_residuals(_path_of(path))

    def load_server_residuals(self, path: Any) -> None:
        """Restores server residuals written by this rank at the same world size."""
        self._inner.load_server_residuals(_path_of(path))

    def discard_server_residuals(self) -> None:
        """Drops this rank's server residuals: the next step starts them at zero.

        A run resumed from worker checkpoints (``load``) past step 0 on the two-phase
        collective fails its steps until it either loads the server residuals saved at the
        same moment (``load_server_residuals``) or calls this.
        """
        self._inner.discard_server_residuals()



class PendingAllReduce:
    """A step started by :meth:`AllReduce.start_`."""

    def __init__(self, native: Any, write_backs: List[Any]) -> None:
        self._native = native
        self._write_backs = write_backs

    def wait(self) -> None:
        """Waits for the step (the GIL released) and writes its results into the gradients it
        was started on. Raises the step's error as :meth:`AllReduce.all_reduce_` raises it (the
        gradients' values are then unspecified); ``ValueError`` when waited for twice."""
        self._native.wait()
        for write_back in self._write_backs:
            write_back()

    @property
    def waited(self) -> bool:
        """Whether :meth:`wait` was called."""
        return bool(self._native.waited)

def _in_place_tensors(
    gradients: Mapping[str, Any], device_copy: bool
) -> Tuple[List[Tuple[str, List[int], Any]], List[Any]]:
    """The native in-place calls' ``(name, shape, flat float32 array)`` of every gradient
    (``_arrays.in_place_f32``), and the copies back that other dtypes, layouts and devices
    need once the results are in."""
    tensors = []
    write_backs = []
    for name, g in gradients.items():
        flat, shape, write_back = in_place_f32(g, device_copy)
        tensors.append((str(name), list(shape), flat))
        if write_back is not None:
            write_backs.append(write_back)
    return tensors, write_backs


def _path_of(path: Any) -> str:
    """A file path from ``str``, ``bytes`` or ``os.PathLike`` (``os.fspath``); ``TypeError`` for
    anything else (``None`` would otherwise become a file named ``None``)."""
    return os.fsdecode(os.fspath(path))


def _bytes_of(data: Any) -> bytes:
    """The bytes of a bytes-like object (``bytes``, ``bytearray``, ``memoryview``, a numpy
    buffer); ``TypeError`` for anything else (``bytes(5)`` is five zero bytes)."""
    return bytes(memoryview(data))


def _shaped(decoded: List[Tuple[str, List[int], Any]], as_torch: bool) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, shape, flat in decoded:
        a = flat.reshape(shape)
        if as_torch:
            import torch

            a = torch.from_numpy(a)
        out[name] = a
    return out
