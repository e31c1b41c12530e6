"""gradwire for PyTorch training: compress every parameter's gradient by name, exchange it
through ``torch.distributed`` and write back the mean, bit-identical on every rank.

Two ways in:

- :func:`all_reduce_gradients`, called after ``loss.backward()`` (no DDP needed);
- :func:`comm_hook` with :class:`HookState`, registered on a ``DistributedDataParallel``
  model: ``model.register_comm_hook(HookState(model, allreduce), comm_hook)``.

The hook keys error feedback by parameter name, not by bucket index, so residuals survive
DDP's bucket rebuilds, and saves them with :meth:`HookState.save`. By default it holds DDP's
buckets until the last one of the step arrives, then runs **one** compressed all-reduce of the
whole model (one bundle per rank per step, whatever the bucketing) and completes every bucket's
future. With ``HookState(..., overlap=True)`` it starts each bucket's step as DDP hands the
bucket over (:meth:`gradwire.AllReduce.start_`: the step runs on the library's thread while
the backward pass computes the next buckets), and completes every future once the last
bucket's step is done. What that means:

- blocking (the default), the backward pass does not overlap with communication (DDP's own
  all-reduce starts each bucket as soon as it is ready): gradwire is for slow links, where the
  bytes dominate; on NVLink or InfiniBand with NCCL a dense all-reduce is usually faster;
- overlapped, every bucket is a step of its own (the buckets of one backward pass carry its
  step number), so a rank sends one bundle per bucket, and the results are the blocking hook's
  for methods that work tensor by tensor (the default: every method, unless the all-reduce was
  given buckets of its own). It needs the all-gather collective (DDP regroups parameters into
  other buckets after the first step; the two-phase collective's server residuals belong to
  one layout), a process group of its own for the all-reduce (its transport is called from the
  library's thread while DDP uses the default group). Mixed precision works as in the
  blocking hook (below): the verdict is the step's, known after its last bucket; the buckets
  that went out before it give back what they took from their residuals (the library keeps a
  copy of their residuals until the step ends: about one model in float32), and every bucket
  comes back NaN. The verdict costs each bucket's step one all-gather of 16 bytes per rank
  (a round of latency each); ``skip_non_finite=False`` leaves it out;
- delayed (``HookState(..., delay=True)``, opt-in: Psyche's one-step-late pipeline), each
  bucket's call hands out at once the mean of the **step before** and leaves this step's
  exchange running behind the next forward and backward pass (started per bucket as in the
  overlapped mode, with its requirements); the optimizer applies every mean one step late.
  The delay acts as momentum of its own: with SGD, lower the optimizer's momentum (the DDP
  example uses 0) and keep its effective step ``lr / (1 - momentum)`` (docs/python.md).
  The first step hands out zeros (no mean exists yet: an optimizer with weight decay or
  momentum still moves at that step, as it would for a zero gradient). Memory: one
  model-sized copy of the gradients in their dtype (the step in flight, then its mean), a
  scratch of the largest parameter, and, while the step is in flight (all of the next
  step), the library's float32 copy of it (``start_``; kept between steps for the next),
  plus a float32 work copy for float16, bfloat16 or CUDA gradients: two to three model-sized
  buffers. Up to 64 buckets of a step go
  out at once (a 65th waits for the first's exchange). An error of step t's exchange (the
  group's: every rank alike) is raised by every rank at step t + 1, whose own exchange still
  starts, so the step after goes on; a rank that cannot start a bucket's exchange hands out
  the mean as its peers do and raises its own error at step t + 1 too; a rank that cannot
  name or swap a bucket's gradients (its held copy no longer matches its peers') raises at
  that step and every later one, and its peers from the next step on (restore from a
  checkpoint). :meth:`HookState.save` waits for the step in flight and stores its mean beside
  the residuals, so a resume is bit for bit; :meth:`HookState.flush` waits for it (its mean
  stays held for the next step; the last step's mean of a run is never applied). A loss
  scaler and ``skip_non_finite`` are refused (a skip would come one step late), and so is
  ``find_unused_parameters=True`` without ``static_graph`` (DDP would drop the mean of a
  parameter unused in a step). The exchange outlives the step: make no call of your own on
  the all-reduce's process group (or mpi4py communicator) between steps;
- under ``no_sync()`` no hook runs (DDP accumulates locally); the next synchronized step
  compresses the accumulated gradients (delayed: a step in flight stays in flight);
- float16 and bfloat16 buckets are compressed as float32 and the mean is written back in the
  bucket's dtype; ``gradient_as_bucket_view=True`` needs nothing else (the gradients are the
  bucket's views);
- mixed precision: by default (``HookState``'s ``skip_non_finite``) a step in which some
  rank's gradient holds NaN or an infinity is skipped on every rank: every bucket comes back
  NaN and no residual changes, so ``torch.amp.GradScaler`` skips the optimizer step and lowers
  its scale, as after DDP's own all-reduce. Given the scaler (``HookState(..., scaler=s)``),
  the hook rescales the residuals when the scale changes (they hold scaled gradients);
- any other error (a rank with other settings, a damaged bundle; a NaN with
  ``skip_non_finite=False``) is raised by every rank's backward pass at the same step, never a
  hang. DDP re-raises it as a ``RuntimeError`` whose message holds the gradwire class and
  message; :attr:`HookState.last_error` keeps the original exception.
"""

import os
import stat
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import AllReduce

__all__ = ["all_reduce_gradients", "HookState", "comm_hook"]


def all_reduce_gradients(model: torch.nn.Module, allreduce: AllReduce) -> None:
    """Replaces every parameter's ``.grad`` by the mean over the ranks, compressed through
    ``allreduce``. Parameters without a gradient are left out (every rank must have the same
    ones: otherwise every rank raises, naming the tensor)."""
    # In place: float32 CPU gradients are read and overwritten where they are (other dtypes
    # and devices cost one copy each way, see AllReduce.all_reduce_).
    with torch.no_grad():
        named = model.named_parameters()
        grads = {n: p.grad for n, p in named if p.grad is not None}
        allreduce._all_reduce_in_place(grads, device_copy=True)


class HookState:
    """The DDP comm hook's state: the all-reduce, and each parameter's name (from
    ``model.named_parameters()``: the keys of the residuals and of the checkpoint).

    ``skip_non_finite`` sets the all-reduce's mode of that name (every rank alike: a step with a
    non-finite gradient on some rank comes back NaN on every rank, for a loss scaler to skip).
    Left out, it is on unless the :class:`~gradwire.AllReduce` was made with a choice of its
    own, which stays. Without a loss scaler, NaN buckets reach the optimizer as they do after
    DDP's own all-reduce. ``scaler``: the ``torch.amp.GradScaler`` of the training loop, whose
    scale the residuals follow (scaled by new / old before the first step after a change).
    ``overlap``: start each bucket's step as DDP hands it over; ``delay``: hand out the step
    before's mean at once and leave this step's exchange in flight (see the module docs)."""

    def __init__(
        self,
        model: torch.nn.Module,
        allreduce: AllReduce,
        skip_non_finite: Optional[bool] = None,
        scaler: Optional[Any] = None,
        overlap: bool = False,
        delay: bool = False,
    ) -> None:
        self.allreduce = allreduce
        self.delay = bool(delay)
        self.overlap = bool(overlap) or self.delay
        if self.delay and scaler is not None and scaler.is_enabled():
            raise ValueError(
                "delay=True with a loss scaler: a step's verdict (skip or not) would come one "
                "step after the optimizer used it; use overlap=True or the blocking hook"
            )
        if self.delay and (skip_non_finite or (skip_non_finite is None and allreduce.skip_non_finite)):
            raise ValueError(
                "delay=True does not skip non-finite steps (a step's verdict would come one step "
                "after the optimizer used it): use overlap=True or the blocking hook"
            )
        if self.delay and getattr(model, "find_unused_parameters", False) and not getattr(model, "static_graph", False):
            raise ValueError(
                "delay=True with find_unused_parameters=True: DDP leaves the gradient of a "
                "parameter unused in a step untouched, so the step before's mean handed out for "
                "it would be lost; use static_graph=True or every parameter in every step"
            )
        if self.overlap:
            _check_overlap(model, allreduce, "delay=True" if self.delay else "overlap=True")
        if self.delay:
            self.allreduce.skip_non_finite = False
        elif skip_non_finite is not None:
            self.allreduce.skip_non_finite = skip_non_finite
        elif not allreduce._skip_chosen:
            self.allreduce.skip_non_finite = True
        self.scaler = scaler
        self.names: Dict[torch.nn.Parameter, str] = {p: n for n, p in model.named_parameters()}
        self._pending: List[Tuple[torch.Tensor, List[torch.nn.Parameter], torch.futures.Future]] = []
        # Overlapped: each bucket's buffer, future and started step (or the error that kept
        # it from starting), in the order DDP handed them over.
        self._in_flight: List[Tuple[torch.Tensor, torch.futures.Future, Any]] = []
        self._rescale_error: Optional[BaseException] = None
        self._local_error: Optional[BaseException] = None
        self.bundle_bytes: int = 0
        # The loss scale the residuals are in (None before the first step with a scaler).
        self._scale: Optional[float] = None
        self.last_error: Optional[BaseException] = None
        # Delayed: each parameter's gradient of the step in flight, by name, in the
        # gradient's dtype and shape (the mean once that step is waited for); whether it
        # holds a mean to hand out; the started steps of the last backward pass; a scratch
        # of the largest parameter for the swap.
        self._held: Dict[str, torch.Tensor] = {}
        self._held_is_mean = False
        self._previous: List[Any] = []
        self._scratch: Optional[torch.Tensor] = None
        self._previous_error: Optional[BaseException] = None
        # Delayed: set when this rank's held copy no longer matches its peers' (a bucket it
        # could not map to names or swap): every later step fails on this rank.
        self._broken: Optional[BaseException] = None

    def save(self, path: Any) -> None:
        """Writes this rank's residuals (keyed by parameter name), step and settings. Delayed
        (``delay=True``): first waits for the step in flight (raising its error, if any), and
        writes the mean it gives, which the next step hands out, beside them in
        ``<path>.delayed`` (``torch.save`` of the tensors by name, the step, and whether there
        is a mean: one model-sized file in the gradients' dtype; written to a new file and
        renamed over the old), so that a resume is bit for bit."""
        if self.delay:
            if self._broken is not None:
                raise RuntimeError(
                    "the delayed hook's held gradients no longer match the other ranks' "
                    f"({type(self._broken).__name__}: {self._broken}): nothing to save"
                )
            self.flush()
        self.allreduce.save(path)
        if self.delay:
            target = _delayed_path(path)
            partial = f"{target}.partial-{os.getpid()}"
            state = {"step": self.allreduce.step, "has_mean": self._held_is_mean, "means": dict(self._held)}
            try:
                torch.save(state, partial)
                os.replace(partial, target)
            except BaseException:
                # A failed save leaves the file that was there, and no partial file.
                if os.path.exists(partial):
                    os.remove(partial)
                raise

    def load(self, path: Any) -> None:
        """Restores residuals written by :meth:`save` with the same method and seed; delayed,
        also the mean the next step hands out (``<path>.delayed``: every parameter of this
        model in its shape and dtype, else ``ValueError`` and nothing loaded; of the step the
        residuals are of, else ``ValueError`` with the residuals loaded and no mean held). A
        step in flight is waited for and dropped, its error with it."""
        if not self.delay:
            self.allreduce.load(path)
            return
        means, step = self._read_delayed(_delayed_path(path))
        previous, self._previous = self._previous, []
        self._wait_all(previous)
        self.allreduce.load(path)
        if step != self.allreduce.step:
            # The residuals are loaded (their step is known only then): no mean is held, so
            # the next step would hand out zeros; load a matching pair before training on.
            self._held, self._held_is_mean = {}, False
            raise ValueError(
                f"{_delayed_path(path)} is the delayed mean of step {step}, the residuals are "
                f"of step {self.allreduce.step}"
            )
        self._held = means
        self._held_is_mean = bool(means)
        self._broken = None

    def _read_delayed(self, path: str) -> Tuple[Dict[str, torch.Tensor], Any]:
        """The means and step of a ``.delayed`` file, checked against this model: a regular
        file (opened without blocking), every parameter's tensor in its shape and dtype."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"{path} is not a regular file")
            saved = torch.load(f, map_location="cpu", weights_only=True)
        means = saved.get("means") if isinstance(saved, dict) else None
        if not isinstance(means, dict):
            raise ValueError(f"{path} is not a delayed mean written by HookState.save")
        by_name = {n: p for p, n in self.names.items()}
        if not saved.get("has_mean"):
            return {}, saved.get("step")
        for name, p in by_name.items():
            t = means.get(name)
            grad_dtype = p.grad.dtype if p.grad is not None else p.dtype
            if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != grad_dtype:
                raise ValueError(f"{path}: tensor {name!r} is missing or not of this model")
        if set(means) != set(by_name):
            raise ValueError(f"{path} holds tensors this model does not have")
        return {n: means[n].to(by_name[n].device) for n in by_name}, saved.get("step")

    def flush(self) -> None:
        """Delayed: waits for the step in flight (the last backward pass's). Its mean stays
        held for the next step to hand out (waiting does not apply it: the last step's mean of
        a run is never applied); its error, if any, is raised here (and not again). Nothing to
        do otherwise."""
        error = self._wait_previous()
        if error is not None:
            raise error

    def _wait_previous(self) -> Optional[BaseException]:
        """Waits for every bucket's step of the step in flight; returns its first error. The
        held copy counts as a mean only after every one was waited for without an error (an
        interrupt half way leaves it marked as none: this rank's own gradients must never be
        handed out as a mean)."""
        previous, self._previous = self._previous, []
        had_mean, self._held_is_mean = self._held_is_mean, False
        error = self._wait_all(previous)
        self._held_is_mean = had_mean and error is None
        return error

    def _views(self, buf: torch.Tensor, params: List[torch.nn.Parameter], grads: Dict[str, torch.Tensor]) -> None:
        """Adds each parameter's slice of the bucket ``buf`` to ``grads``, by name."""
        at = 0
        for p in params:
            n = p.numel()
            name = self.names.get(p)
            if name is None:
                raise ValueError("a bucket holds a parameter HookState was not given")
            grads[name] = buf[at : at + n].view(p.shape)
            at += n
        if at != buf.numel():
            raise ValueError(f"a bucket of {buf.numel()} elements holds parameters of {at}")

    def _fail(self, e: BaseException, futures: List[torch.futures.Future]) -> None:
        """Every future of the step carries its error ``e`` (kept in :attr:`last_error`)."""
        self.last_error = e
        # DDP re-raises a future's error as a RuntimeError of its message: the message
        # names the class, so that it is not lost.
        cls = type(e)
        named = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
        carried = RuntimeError(f"{named}: {e}")
        for fut in futures:
            fut.set_exception(carried)

    def _start_bucket(self, bucket: dist.GradBucket, fut: torch.futures.Future) -> None:
        """Overlapped: starts the bucket's step now; after the last bucket, waits for every
        step of the backward pass and completes their futures."""
        buf = bucket.buffer()
        last = bucket.is_last()
        if not self._in_flight:
            self.last_error = None
            self._rescale_error = None
            self._local_error = None
            try:
                self._follow_scale()
            except Exception as e:
                # As in the blocking hook: this rank takes part with NaN gradients (every
                # rank fails the step alike), then raises its own error.
                self._rescale_error = e
        started: Any
        try:
            grads: Dict[str, torch.Tensor] = {}
            self._views(buf, list(bucket.parameters()), grads)
            if self._rescale_error is not None:
                with torch.no_grad():
                    for g in grads.values():
                        g.fill_(float("nan"))
            with torch.no_grad():
                started = self.allreduce._start_in_place(grads, ends_step=last, device_copy=True)
        except Exception as e:
            # This rank could not start the bucket's step: it still takes part, with no
            # tensors, so that every rank fails that call alike (another layout) and the
            # ranks' calls stay paired; it raises its own error after the last bucket.
            self._local_error = self._local_error or e
            started = self._take_part_empty(last)
        self._in_flight.append((buf, fut, started))
        if last:
            self._finish_overlapped()

    @staticmethod
    def _wait_all(started: List[Any]) -> Optional[BaseException]:
        """Waits for every started step (or error) of ``started``; returns the first error."""
        first: Optional[BaseException] = None
        for one in started:
            if isinstance(one, BaseException):
                first = first or one
                continue
            try:
                one.wait()
            except Exception as e:
                first = first or e
        return first

    def _start_delayed(self, bucket: dist.GradBucket, fut: torch.futures.Future) -> None:
        """Delayed: at the first bucket of a backward pass, waits for the step before (every
        bucket of the last backward pass: it had the whole forward pass to finish); then, for
        each bucket, hands out the held mean of that step (zeros at the first step), keeps
        this step's gradient in its place and starts its exchange."""
        buf = bucket.buffer()
        last = bucket.is_last()
        if not self._in_flight:
            self.last_error = None
            self._local_error = None
            self._previous_error = self._wait_previous()
        started: Any = None
        if self._broken is None:
            try:
                grads: Dict[str, torch.Tensor] = {}
                self._views(buf, list(bucket.parameters()), grads)
                with torch.no_grad():
                    for name, g in grads.items():
                        self._swap_held(name, g)
            except Exception as e:
                # This rank's held copy no longer matches its peers' (a bucket it cannot name
                # or swap): it fails this step and every later one, taking part with no
                # tensors so that no peer waits; its peers fail from the next step on.
                self._broken = e
            else:
                try:
                    with torch.no_grad():
                        started = self.allreduce._start_in_place(
                            {n: self._held[n] for n in grads}, ends_step=last, device_copy=True
                        )
                except Exception as e:
                    # The mean handed out is the step before's, as on every rank; this step's
                    # exchange fails on every rank alike (this rank takes part with no
                    # tensors), and this rank raises its own error with the others' at the
                    # next step.
                    self._local_error = self._local_error or e
        if started is None:
            started = self._take_part_empty(last)
        self._in_flight.append((buf, fut, started))
        if last:
            in_flight, self._in_flight = self._in_flight, []
            self._previous = [started for _, _, started in in_flight]
            self._held_is_mean = True
            if self._local_error is not None:
                # Raised by this rank at the next step, before the group's error it caused.
                self._previous.insert(0, self._local_error)
            if self._broken is not None:
                error: Optional[BaseException] = RuntimeError(
                    f"the delayed hook's held gradients no longer match the other ranks' "
                    f"({type(self._broken).__name__}: {self._broken}): restore from a checkpoint"
                )
            else:
                error = self._previous_error
            if error is not None:
                self._fail(error, [fut for _, fut, _ in in_flight])
                return
            for buf, fut, _ in in_flight:
                fut.set_result(buf)

    def _take_part_empty(self, last: bool) -> Any:
        """Starts this rank's part of a step with no tensors (its peers' step then fails alike
        instead of waiting); returns the handle, or the error if even that fails."""
        try:
            return self.allreduce._start_in_place({}, ends_step=last, device_copy=True)
        except Exception as again:
            return again

    def _swap_held(self, name: str, g: torch.Tensor) -> None:
        """Puts the held mean of ``name`` (zeros when there is none) into the bucket's view
        ``g`` and this step's gradient into the held tensor, through a scratch tensor of the
        largest parameter."""
        held = self._held.get(name)
        fresh = held is None or held.shape != g.shape or held.dtype != g.dtype or held.device != g.device
        if fresh:
            held = torch.empty_like(g, memory_format=torch.contiguous_format)
            self._held[name] = held
        n = g.numel()
        scratch = self._scratch
        if scratch is None or scratch.numel() < n or scratch.dtype != g.dtype or scratch.device != g.device:
            keep = scratch.numel() if scratch is not None and scratch.dtype == g.dtype else 0
            scratch = self._scratch = torch.empty(max(n, keep), dtype=g.dtype, device=g.device)
        tmp = scratch[:n].view(g.shape)
        tmp.copy_(g)
        if self._held_is_mean and not fresh:
            g.copy_(held)
        else:
            g.zero_()
        held.copy_(tmp)

    def _finish_overlapped(self) -> None:
        in_flight, self._in_flight = self._in_flight, []
        first = self._wait_all([started for _, _, started in in_flight])
        # (`bundle_bytes` is the blocking hook's: reading the all-reduce's message size here
        # would stop its thread after every backward pass.)
        first = self._rescale_error or self._local_error or first
        if first is not None:
            self._fail(first, [fut for _, fut, _ in in_flight])
            return
        # A skipped step (some rank's gradient not finite): the library put back the
        # residuals of the buckets that went out before the verdict and handed back the
        # bucket that found it and every later one all NaN, the last one always; the earlier
        # buckets' results are void, so every bucket comes back NaN, for a loss scaler to skip
        # the step.
        last = in_flight[-1][0].reshape(-1)
        if self.allreduce.skip_non_finite and last.numel() > 0 and bool(torch.isnan(last[0])):
            with torch.no_grad():
                for buf, _, _ in in_flight:
                    buf.fill_(float("nan"))
        for buf, fut, _ in in_flight:
            fut.set_result(buf)

    def _all_reduce_held(self) -> None:
        pending, self._pending = self._pending, []
        grads: Dict[str, torch.Tensor] = {}
        self.last_error = None
        local_error: Optional[BaseException] = None
        try:
            for buf, params, fut in pending:
                self._views(buf, params, grads)
        except Exception as e:
            # This rank cannot name its gradients: it still takes part, with no tensors, so
            # that every rank fails the step alike (another layout); then it raises its own.
            local_error = e
            grads = {}
        rescale_error: Optional[BaseException] = local_error
        try:
            if local_error is None:
                self._follow_scale()
        except Exception as e:
            # This rank's residuals could not follow the scale: it still takes part in the
            # step, with NaN gradients, so that every rank skips it (or, without the mode,
            # fails it) alike; then it raises its own error.
            rescale_error = e
            with torch.no_grad():
                for g in grads.values():
                    g.fill_(float("nan"))
        try:
            # Each parameter's slice of its bucket is read and overwritten in place.
            with torch.no_grad():
                self.allreduce._all_reduce_in_place(grads, device_copy=True)
            self.bundle_bytes = self.allreduce.last_message_bytes
            if rescale_error is not None:
                raise rescale_error
        except Exception as e:  # every bucket's future carries the step's error
            # (this rank's own error first: its peers' say only that it failed)
            self._fail(rescale_error or e, [fut for _, _, fut in pending])
            return
        for buf, _, fut in pending:
            fut.set_result(buf)


    def _follow_scale(self) -> None:
        """Scales the residuals by new / old when the scaler's scale changed since the last
        step (GradScaler halves it after a skipped step and doubles it after a run of good
        ones: powers of two, so the residuals scale exactly)."""
        if self.scaler is None or not self.scaler.is_enabled():
            return
        scale = float(self.scaler.get_scale())
        if self._scale is not None and scale != self._scale:
            self.allreduce.scale_residuals(scale / self._scale)
        self._scale = scale


def _check_overlap(
    model: torch.nn.Module, allreduce: AllReduce, mode: str
) -> None:
    """``ValueError`` for an all-reduce the overlapped (or delayed: ``mode``) hook of
    ``model`` (a DDP model) cannot run (see the module docs)."""
    if allreduce.collective != "allgather":
        raise ValueError(
            f"{mode} runs a step per DDP bucket, and DDP regroups parameters into other "
            f"buckets after the first step: the {allreduce.collective!r} collective keeps server "
            f"residuals of one layout; use collective='allgather'"
        )
    missing = object()  # a transport without process groups (mpi4py, a test's)
    group = getattr(allreduce.communicator, "group", missing)
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    ddps = getattr(model, "process_group", missing)
    if group is not missing and (group is None or group is ddps or (world is not None and group is world)):
        raise ValueError(
            f"{mode} calls the transport from the library's thread while DDP uses its own "
            "process group (the default one, unless DDP was given another): give the "
            "AllReduce a group of its own (TorchDistributed(torch.distributed.new_group()))"
        )
    # mpi4py's world communicator is the training loop's too (an allreduce of the loss would
    # meet the library thread's calls): a duplicate of its own, as for a torch group.
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and getattr(allreduce.communicator, "comm", None) is mpi.COMM_WORLD:
        raise ValueError(
            f"{mode} calls the transport from the library's thread: give the AllReduce a "
            "communicator of its own (gradwire.comm.Mpi4py(MPI.COMM_WORLD.Dup()))"
        )


# Annotations as objects, not strings: DDP's register_comm_hook checks them.
def comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: ``model.register_comm_hook(state, comm_hook)``. Returns a future that
    completes with the bucket's mean once the step's last bucket has been all-reduced (with
    ``HookState(..., overlap=True)`` every bucket's step starts at once; with ``delay=True``
    the future completes at the step's last bucket with the mean of the step before)."""
    fut: torch.futures.Future = torch.futures.Future()
    if state.delay:
        state._start_delayed(bucket, fut)
        return fut
    if state.overlap:
        state._start_bucket(bucket, fut)
        return fut
    state._pending.append((bucket.buffer(), list(bucket.parameters()), fut))
    if bucket.is_last():
        state._all_reduce_held()
    return fut


def _delayed_path(path: Any) -> str:
    """Where :meth:`HookState.save` writes the delayed mean beside the residuals at ``path``."""
    return os.fspath(path) + ".delayed"
