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
  library's thread while DDP uses the default group), and, for now, no ``skip_non_finite``
  (the verdict of a step would be known only after its first buckets went out);
- delayed (``HookState(..., delay=True)``, opt-in: Psyche's one-step-late pipeline), each
  bucket's call hands out at once the mean of the **step before** and leaves this step's
  exchange running behind the next forward and backward pass (started per bucket as in the
  overlapped mode, with its requirements); the optimizer applies every mean one step late.
  The first step hands out zeros (no mean exists yet: an optimizer with weight decay or
  momentum still moves at that step, as it would for a zero gradient). It keeps one
  model-sized copy of the gradients in their dtype (the step in flight, then its mean) and a
  scratch of the largest parameter. An error of step t's exchange (the group's: every rank
  alike) is raised by every rank at step t + 1, whose own exchange still starts, so the step
  after goes on; a rank that cannot start a bucket raises its own error at that step.
  :meth:`HookState.save` waits for the step in flight and stores its mean beside the
  residuals, so a resume is bit for bit; :meth:`HookState.flush` waits for it (its mean stays
  held for the next step; the last step's mean of a run is never applied). A loss scaler is
  refused (its skip would come one step late);
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
        if self.delay and scaler is not None:
            raise ValueError(
                "delay=True with a loss scaler: a step's verdict (skip or not) would come one "
                "step after the optimizer used it; use overlap=True or the blocking hook"
            )
        if self.overlap:
            _check_overlap(model, allreduce, skip_non_finite, "delay=True" if self.delay else "overlap=True")
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

    def save(self, path: Any) -> None:
        """Writes this rank's residuals (keyed by parameter name), step and settings. Delayed
        (``delay=True``): first waits for the step in flight (raising its error, if any), and
        writes the mean it gives, which the next step hands out, beside them in
        ``<path>.delayed`` (``torch.save`` of the tensors by name, the step, and whether there
        is a mean: one model-sized file in the gradients' dtype), so that a resume is bit for
        bit."""
        if self.delay:
            self.flush()
        self.allreduce.save(path)
        if self.delay:
            torch.save(
                {"step": self.allreduce.step, "has_mean": self._held_is_mean, "means": dict(self._held)},
                _delayed_path(path),
            )

    def load(self, path: Any) -> None:
        """Restores residuals written by :meth:`save` with the same method and seed; delayed,
        also the mean the next step hands out (``<path>.delayed``, which must be of the same
        step as the residuals)."""
        if not self.delay:
            self.allreduce.load(path)
            return
        saved = torch.load(_delayed_path(path), weights_only=True)
        self.flush()
        self.allreduce.load(path)
        if not isinstance(saved, dict) or saved.get("step") != self.allreduce.step:
            raise ValueError(
                f"{_delayed_path(path)} is not the delayed mean of the residuals' step "
                f"{self.allreduce.step}"
            )
        by_name = {n: p for p, n in self.names.items()}
        means = saved.get("means", {})
        for name, t in means.items():
            p = by_name.get(name)
            if p is None or not isinstance(t, torch.Tensor) or t.shape != p.shape:
                raise ValueError(f"{_delayed_path(path)}: tensor {name!r} is not of this model")
        self._held = {n: t.to(by_name[n].device) for n, t in means.items()}
        self._held_is_mean = bool(saved.get("has_mean")) and bool(self._held)

    def flush(self) -> None:
        """Delayed: waits for the step in flight (the last backward pass's). Its mean stays
        held for the next step to hand out; its error, if any, is raised here (and not again).
        Nothing to do otherwise."""
        previous, self._previous = self._previous, []
        error = self._wait_all(previous)
        if error is not None:
            self._held_is_mean = False
            raise error

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
            try:
                started = self.allreduce._start_in_place({}, ends_step=last, device_copy=True)
            except Exception as again:
                started = again
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
            previous, self._previous = self._previous, []
            self._previous_error = self._wait_all(previous)
            if self._previous_error is not None:
                self._held_is_mean = False
        started: Any
        try:
            grads: Dict[str, torch.Tensor] = {}
            self._views(buf, list(bucket.parameters()), grads)
            with torch.no_grad():
                for name, g in grads.items():
                    self._swap_held(name, g)
                started = self.allreduce._start_in_place(
                    {n: self._held[n] for n in grads}, ends_step=last, device_copy=True
                )
        except Exception as e:
            # As in the overlapped hook: this rank takes part with no tensors, so that every
            # rank fails that step alike; it raises its own error with this step.
            self._local_error = self._local_error or e
            try:
                started = self.allreduce._start_in_place({}, ends_step=last, device_copy=True)
            except Exception as again:
                started = again
        self._in_flight.append((buf, fut, started))
        if last:
            in_flight, self._in_flight = self._in_flight, []
            self._previous = [started for _, _, started in in_flight]
            self._held_is_mean = True
            error = self._local_error or self._previous_error
            if error is not None:
                self._fail(error, [fut for _, fut, _ in in_flight])
                return
            for buf, fut, _ in in_flight:
                fut.set_result(buf)

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
        if self._scratch is None or self._scratch.numel() < n or self._scratch.dtype != g.dtype or self._scratch.device != g.device:
            self._scratch = torch.empty(max(n, self._scratch.numel() if self._scratch is not None else 0), dtype=g.dtype, device=g.device)
        tmp = self._scratch[:n].view(g.shape)
        tmp.copy_(g)
        if self._held_is_mean and not fresh:
            g.copy_(held)
        else:
            g.zero_()
        held.copy_(tmp)

    def _finish_overlapped(self) -> None:
        in_flight, self._in_flight = self._in_flight, []
        first: Optional[BaseException] = None
        for _, _, started in in_flight:
            if isinstance(started, BaseException):
                first = first or started
                continue
            try:
                started.wait()
            except Exception as e:
                first = first or e
        # (`bundle_bytes` is the blocking hook's: reading the all-reduce's message size here
        # would stop its thread after every backward pass.)
        first = self._rescale_error or self._local_error or first
        if first is not None:
            self._fail(first, [fut for _, fut, _ in in_flight])
            return
        for buf, fut, _ in in_flight:
            fut.set_result(buf)

    def _flush(self) -> None:
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
    model: torch.nn.Module, allreduce: AllReduce, skip_non_finite: Optional[bool], mode: str
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
    if skip_non_finite or (skip_non_finite is None and allreduce.skip_non_finite):
        raise ValueError(
            f"{mode} does not skip non-finite steps yet (a bucket's verdict comes after "
            "the buckets before it went out): use the blocking hook with a loss scaler"
        )


# Annotations as objects, not strings: DDP's register_comm_hook checks them.
def comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: ``model.register_comm_hook(state, comm_hook)``. Returns a future that
    completes with the bucket's mean once the step's last bucket has been all-reduced (with
    ``HookState(..., overlap=True)`` every bucket's step starts at once)."""
    fut: torch.futures.Future = torch.futures.Future()
    if state.delay:
        state._start_delayed(bucket, fut)
        return fut
    if state.overlap:
        state._start_bucket(bucket, fut)
        return fut
    state._pending.append((bucket.buffer(), list(bucket.parameters()), fut))
    if bucket.is_last():
        state._flush()
    return fut


def _delayed_path(path: Any) -> str:
    """Where :meth:`HookState.save` writes the delayed mean beside the residuals at ``path``."""
    import os

    return os.fspath(path) + ".delayed"
