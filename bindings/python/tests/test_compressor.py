"""gradwire.Compressor: bundles, rank-order aggregation, residual checkpoints, bad input."""

import math
import os

import numpy as np
import pytest

import gradwire

METHODS = [
    "topk k=ratio:0.01 values=int8:256",
    "topk k=ratio:0.01 values=f32",
    "randomk k=ratio:0.01 values=f32 unbiased=false",
    "sign scale=mean-abs:1024",
    "quant bits=4 block=512 rounding=nearest-even",
    "dense values=f16",
]


def rank_grads(grads, rank):
    rng = np.random.default_rng(rank)
    return {n: g + rng.standard_normal(g.shape).astype(np.float32) * 1e-3 for n, g in grads.items()}


@pytest.mark.parametrize("method", METHODS)
def test_error_feedback_loses_nothing(grads_step1, method):
    c = gradwire.Compressor(method, seed=7)
    assert c.method == method and c.error_feedback and c.step == 0
    bundle = c.compress(grads_step1)
    assert c.step == 1 and c.last_bundle_bytes == len(bundle)
    assert c.dense_bytes == 4 * sum(g.size for g in grads_step1.values())
    assert len(bundle) < c.dense_bytes
    sent = c.decompress(bundle, rank=0)
    residual = c.residuals()
    assert list(sent) == list(residual) == sorted(grads_step1)
    for name, g in grads_step1.items():
        assert sent[name].shape == residual[name].shape == g.shape
        assert sent[name].dtype == np.float32
        # Nothing lost: sent + residual == gradient (the residual started empty), to the f32
        # rounding of r = g - sent and of the sum (half an ulp of the larger operand each).
        bound = 2.0**-23 * (np.abs(sent[name]) + np.abs(g))
        assert (np.abs(sent[name] + residual[name] - g) <= bound).all(), name
        if method.startswith("topk") and "int8" not in method:
            assert np.array_equal(sent[name] + residual[name], g)
    # A compressor restored from another's residuals sends the same next bundle.
    c2 = gradwire.Compressor(method, seed=7)
    c2.compress(grads_step1)
    assert c.compress(grads_step1) == c2.compress(grads_step1)
    assert gradwire.Compressor(method, error_feedback=False).residuals() == {}


@pytest.mark.parametrize("method", METHODS[:2])
def test_checkpoint_resume_is_bit_identical(tmp_path, grads_step1, grads_step2, method):
    a = gradwire.Compressor(method, seed=3)
    a.compress(grads_step1)
    a.save(tmp_path / "state.safetensors")
    b = gradwire.Compressor(method, seed=3)
    b.load(tmp_path / "state.safetensors")
    assert b.step == a.step == 1
    assert a.compress(grads_step2) == b.compress(grads_step2)
    other_seed = gradwire.Compressor(method, seed=4)
    with pytest.raises(gradwire.PayloadError):
        other_seed.load(tmp_path / "state.safetensors")
    damaged = bytearray((tmp_path / "state.safetensors").read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    (tmp_path / "damaged.safetensors").write_bytes(bytes(damaged))
    with pytest.raises(gradwire.PayloadError):
        gradwire.Compressor(method, seed=3).load(tmp_path / "damaged.safetensors")
    with pytest.raises(OSError):
        gradwire.Compressor(method, seed=3).load(tmp_path / "missing.safetensors")


def test_aggregate_is_the_rank_order_mean(grads_step1):
    method = "topk k=ratio:0.01 values=f32"
    ranks = [gradwire.Compressor(method, seed=1) for _ in range(4)]
    bundles = [c.compress(rank_grads(grads_step1, r), rank=r) for r, c in enumerate(ranks)]
    means = [c.aggregate(bundles) for c in ranks]
    for m in means[1:]:
        for name in m:
            assert m[name].tobytes() == means[0][name].tobytes()
    decoded = [ranks[0].decompress(b, rank=r) for r, b in enumerate(bundles)]
    for name in means[0]:
        total = np.zeros_like(decoded[0][name])
        for d in decoded:
            total = total + d[name]
        np.testing.assert_allclose(means[0][name], total / 4, rtol=1e-6, atol=1e-9)
    sums = ranks[0].aggregate(bundles, reduction="sum")
    for name in sums:
        np.testing.assert_allclose(sums[name], means[0][name] * 4, rtol=1e-6)
    with pytest.raises(gradwire.PayloadError):
        ranks[0].aggregate([bundles[1], bundles[0]] + bundles[2:])
    with pytest.raises(ValueError, match="reduction"):
        ranks[0].aggregate(bundles, reduction="median")


def test_majority_vote():
    grads = {"w": np.array([1.0, -2.0, 3.0, -4.0], np.float32)}
    ranks = [gradwire.Compressor("sign scale=none", error_feedback=False) for _ in range(3)]
    votes = [c.compress({"w": grads["w"] * s}, rank=r) for r, (c, s) in enumerate(zip(ranks, [1, 1, -1]))]
    out = ranks[0].aggregate(votes, reduction="majority-vote")
    np.testing.assert_array_equal(out["w"], [1.0, -1.0, 1.0, -1.0])


def test_a_rank_with_other_settings_is_refused(grads_step1):
    # Another k; another seed where decoding depends on it (random-k regenerates the indices).
    a = gradwire.Compressor("randomk k=ratio:0.01 values=f32 unbiased=false", seed=1)
    b = gradwire.Compressor("randomk k=ratio:0.02 values=f32 unbiased=false", seed=1)
    c = gradwire.Compressor("randomk k=ratio:0.01 values=f32 unbiased=false", seed=2)
    ba = a.compress(grads_step1, rank=0)
    bb = b.compress(grads_step1, rank=1)
    bc = c.compress(grads_step1, rank=1)
    for other in (bb, bc):
        with pytest.raises(gradwire.PayloadError):
            a.aggregate([ba, other])
        with pytest.raises(gradwire.PayloadError):
            a.decompress(other)


def test_bad_input(grads_step1):
    with pytest.raises(ValueError):
        gradwire.Compressor("topk k=sometimes")
    with pytest.raises(ValueError, match="error feedback"):
        gradwire.Compressor("sign scale=none", error_feedback=True)
    c = gradwire.Compressor("topk k=ratio:0.01 values=f32")
    with pytest.raises(ValueError, match="no model yet"):
        c.decompress(b"")
    bad = dict(grads_step1)
    name = next(n for n in sorted(bad) if bad[n].ndim == 2)
    bad[name] = bad[name].copy()
    bad[name].reshape(-1)[17] = math.nan
    with pytest.raises(ValueError, match="17"):
        c.compress(bad)
    assert c.step == 0
    c.compress(grads_step1)
    renamed = {("x" + n): g for n, g in grads_step1.items()}
    with pytest.raises(ValueError):
        c.compress(renamed)
    reshaped = dict(grads_step1)
    reshaped[name] = reshaped[name].reshape(-1)
    with pytest.raises(ValueError):
        c.compress(reshaped)
    # Beyond f16: the caller's error without error feedback; with it (the default) the value
    # is sent saturated, 65504, and the residual keeps the rest.
    f16 = gradwire.Compressor("dense values=f16", error_feedback=False)
    with pytest.raises(ValueError):
        f16.compress({"w": np.array([1e6], np.float32)})
    f16 = gradwire.Compressor("dense values=f16")
    sent = f16.decompress(f16.compress({"w": np.array([1e6], np.float32)}))
    assert sent["w"].tolist() == [65504.0]
    with pytest.raises(ValueError, match="error feedback"):
        gradwire.Compressor("topk k=ratio:0.5 values=f32", error_feedback=False).save("x")


def test_hostile_bundles(grads_step1):
    c = gradwire.Compressor("topk k=ratio:0.01 values=int8:256", seed=5)
    bundle = c.compress(grads_step1)
    for cut in range(0, len(bundle), max(1, len(bundle) // 97)):
        with pytest.raises(gradwire.PayloadError):
            c.decompress(bundle[:cut])
    for i in range(0, len(bundle), max(1, len(bundle) // 211)):
        damaged = bytearray(bundle)
        damaged[i] ^= 0x04
        with pytest.raises(gradwire.PayloadError):
            c.decompress(bytes(damaged))
    with pytest.raises(gradwire.PayloadError):
        c.decompress(bundle, rank=1)


def test_shapes_up_front(grads_step1):
    shapes = {n: g.shape for n, g in grads_step1.items()}
    sender = gradwire.Compressor("topk k=ratio:0.01 values=f32")
    receiver = gradwire.Compressor("topk k=ratio:0.01 values=f32", shapes=shapes)
    assert receiver.shapes == dict(sorted(shapes.items()))
    bundle = sender.compress(grads_step1)
    a = receiver.decompress(bundle)
    b = sender.decompress(bundle)
    for n in a:
        assert a[n].tobytes() == b[n].tobytes()


def test_loads_refuse_fifos_and_devices_at_once(tmp_path):
    """Issue 48 class 5: ``Compressor.load`` and ``AllReduce.load`` / ``load_server_residuals``
    read through the library's checkpoint reader, which opens a file without blocking and
    looks at the handle: a FIFO nobody writes to (which blocked ``open``) and ``/dev/zero``
    (read until memory ran out) raise at once, naming the file. A thread with a 30 s guard
    only: no timing."""
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    c = gradwire.Compressor("topk k=ratio:0.01 values=f32", seed=3)
    ar = gradwire.AllReduce("topk k=ratio:0.05 values=f16", _AloneCommunicator(), collective="two-phase")
    for path in (str(fifo), "/dev/zero"):
        for load in (c.load, ar.load, ar.load_server_residuals):
            outcome = []

            def call():
                try:
                    load(path)
                    outcome.append(None)
                except Exception as e:
                    outcome.append(e)

            t = threading.Thread(target=call, daemon=True)
            t.start()
            t.join(30)
            assert outcome, f"{load.__qualname__}({path}) blocked"
            e = outcome[0]
            assert isinstance(e, (ValueError, gradwire.PayloadError)), repr(e)
            assert path in str(e) and "not a regular file" in str(e), str(e)


def test_paths_and_bytes_take_their_types_only(tmp_path, monkeypatch, grads_step1):
    """Issue 48 class 7: ``save(None)`` wrote ``./None``, ``load(b"/path")`` looked for
    ``b'/path'``, ``decompress(5)`` decoded five zero bytes; a shape of ``2**62`` elements,
    reported with ``dense_bytes`` 0, is refused when the compressor is made."""
    monkeypatch.chdir(tmp_path)
    method = "topk k=ratio:0.01 values=f32"
    c = gradwire.Compressor(method, seed=3)
    bundle = c.compress(grads_step1)
    with pytest.raises(TypeError):
        c.save(None)
    assert not (tmp_path / "None").exists()
    with pytest.raises(TypeError):
        c.load(7)
    # bytes and os.PathLike paths name the file they spell.
    path = tmp_path / "state.safetensors"
    c.save(os.fsencode(path))
    assert path.exists()
    d = gradwire.Compressor(method, seed=3)
    d.load(os.fsencode(path))
    assert d.step == c.step
    with pytest.raises(TypeError):
        c.decompress(5)
    with pytest.raises(TypeError):
        c.aggregate([bundle, 5])
    # Bytes-like objects are read as they are.
    a = c.decompress(bytearray(bundle))
    b = c.decompress(memoryview(bundle))
    for n in a:
        assert a[n].tobytes() == b[n].tobytes()
    # A model too large for one bundle is refused up front (its dense_bytes cannot wrap).
    with pytest.raises(ValueError, match="too large"):
        gradwire.Compressor(method, shapes={"w": [2**62]})
    assert gradwire.Compressor(method, shapes={"w": [2, 3]}).dense_bytes == 24


def test_a_checkpoint_larger_than_memory_raises_memory_error(tmp_path):
    # Issue 48 class 7: a failed allocation in Rust aborted the interpreter or surfaced as
    # another error. A valid checkpoint header declaring a residual of 2^37 float32 (512 GiB,
    # a sparse file) is refused with MemoryError before anything of it is read.
    import json
    import struct

    method = "topk k=count:1 values=f32"
    c = gradwire.Compressor(method, seed=0)
    n = 1 << 37
    meta = {
        "format": "gradwire-error-feedback",
        "version": "3",
        "method": c.method,
        "seed": "0",
        "step": "0",
        "unshaped": '["w"]',
        "crc32": "0",
    }
    header = json.dumps(
        {"__metadata__": meta, "w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}},
        separators=(",", ":"),
    ).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        f.truncate(8 + len(header) + 4 * n)
    with pytest.raises(MemoryError):
        c.load(path)
    assert c.step == 0


def test_a_copy_beyond_memory_raises_memory_error():
    # Issue 48 class 7: the bindings copy each gradient in; a copy that cannot be had aborted
    # the interpreter (Rust's failed allocation). In a child process whose address space
    # leaves room for a 200 MB gradient but not for its copy, compress raises MemoryError.
    import subprocess
    import sys
    import textwrap

    child = textwrap.dedent(
        """
        import resource
        import numpy as np
        import gradwire
        c = gradwire.Compressor("topk k=ratio:0.01 values=f32", error_feedback=False)
        c.compress({"w": np.ones(1000, np.float32)})
        g = np.ones(50_000_000, np.float32)
        with open("/proc/self/status") as f:
            size = next(int(l.split()[1]) for l in f if l.startswith("VmSize:")) * 1024
        limit = size + (64 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            c.compress({"w": g})
        except MemoryError as e:
            print("MemoryError:", e)
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "MemoryError: tensor \"w\": cannot allocate 50000000 elements" in done.stdout, done.stdout


@pytest.mark.parametrize(
    "method, collective, error_feedback, room_mb, call, want",
    [
        # The worker residual (the first step's) on the in-place path: no copy before it.
        ("topk k=ratio:0.01 values=int8:256", "allgather", True, 64, "all_reduce_",
         "tensor `w`: cannot allocate 50000000 elements"),
        # The server residuals of the two-phase collective (allocated before the worker's).
        ("sign scale=mean-abs:1024", "two-phase", True, 64, "all_reduce_",
         "the server residuals: cannot allocate 50000000 elements"),
        # The output map of the copying path, after the gradient's copy fits.
        ("dense values=f32", "allgather", False, 232, "all_reduce",
         "tensor `w`: cannot allocate 50000000 elements"),
    ],
)
def test_a_step_beyond_memory_raises_memory_error(method, collective, error_feedback, room_mb, call, want):
    # Issue 48 class 7: the state a step allocates the size of the model (a worker residual,
    # the server residuals, the copying path's outputs) aborted the interpreter when the memory
    # could not be had. In a child process whose address space leaves `room_mb` beyond the
    # 200 MB gradient, the step raises MemoryError and the process lives on.
    import subprocess
    import sys
    import textwrap

    child = textwrap.dedent(
        f"""
        import resource
        import numpy as np
        import gradwire
        import test_compressor as t
        warm = gradwire.AllReduce({method!r}, t._AloneCommunicator(), error_feedback={error_feedback},
                                  collective={collective!r})
        getattr(warm, {call!r})({{"w": np.ones(1000, np.float32)}})
        ar = gradwire.AllReduce({method!r}, t._AloneCommunicator(), error_feedback={error_feedback},
                                collective={collective!r})
        g = np.ones(50_000_000, np.float32)
        with open("/proc/self/status") as f:
            size = next(int(l.split()[1]) for l in f if l.startswith("VmSize:")) * 1024
        limit = size + ({room_mb} << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            getattr(ar, {call!r})({{"w": g}})
            print("no error")
        except MemoryError as e:
            print("MemoryError:", e)
        """
    )
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=here)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert f"MemoryError: {want}" in done.stdout, done.stdout


class _AloneCommunicator:
    """A group of one rank: what it sends is what it receives (a real world of size 1)."""

    rank = 0
    world_size = 1

    def all_gather(self, data, lengths):
        return [bytes(data)]

    def all_to_all(self, send, recv_lengths):
        return [bytes(b) for b in send]


def test_a_resume_without_server_residuals_fails_until_loaded_or_discarded(tmp_path, grads_step1, grads_step2):
    """Issue 48 class 4: workers resumed on the two-phase collective without the server residuals
    of the same moment would restart the owners from zeros, silently; the step fails until the
    caller loads them or discards them."""
    method = "sign scale=mean-abs:1024"
    a = gradwire.AllReduce(method, _AloneCommunicator(), collective="two-phase")
    a.all_reduce(grads_step1)
    a.save(tmp_path / "worker.safetensors")
    a.save_server_residuals(tmp_path / "server.safetensors")
    expected = a.all_reduce(grads_step2)

    b = gradwire.AllReduce(method, _AloneCommunicator(), collective="two-phase")
    b.load(tmp_path / "worker.safetensors")
    with pytest.raises(ValueError, match="discard_server_residuals"):
        b.all_reduce(grads_step2)

    both = gradwire.AllReduce(method, _AloneCommunicator(), collective="two-phase")
    both.load(tmp_path / "worker.safetensors")
    both.load_server_residuals(tmp_path / "server.safetensors")
    got = both.all_reduce(grads_step2)
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in expected.items()}

    c = gradwire.AllReduce(method, _AloneCommunicator(), collective="two-phase")
    c.load(tmp_path / "worker.safetensors")
    c.discard_server_residuals()
    c.all_reduce(grads_step2)


@pytest.mark.parametrize(
    "method, collective",
    [
        ("topk k=ratio:0.01 values=int8:256", "allgather"),
        ("sign scale=mean-abs:1024", "two-phase"),
        ("dense values=f32", "allgather"),
    ],
)
def test_all_reduce_in_place_is_all_reduce_bit_for_bit(method, collective, grads_step1, grads_step2):
    """Issue 47 scope 4: ``all_reduce_`` overwrites the caller's float32 arrays with the result,
    reading them where they are; the results and the residuals are those of ``all_reduce``."""
    apart = gradwire.AllReduce(method, _AloneCommunicator(), collective=collective)
    in_place = gradwire.AllReduce(method, _AloneCommunicator(), collective=collective)
    for grads in (grads_step1, grads_step2):
        expected = apart.all_reduce(grads)
        arrays = {k: np.array(v, dtype=np.float32, order="C") for k, v in grads.items()}
        before = {k: a.__array_interface__["data"][0] for k, a in arrays.items()}
        assert in_place.all_reduce_(arrays) is None
        assert in_place.last_step_seconds > 0
        for k, a in arrays.items():
            assert a.__array_interface__["data"][0] == before[k], k
            assert a.tobytes() == expected[k].tobytes(), k
    assert in_place.step == apart.step == 2


def test_all_reduce_in_place_reads_float32_where_it_is_and_copies_other_layouts(grads_step1):
    """No copy for a C-contiguous float32 array; one copy in and one back for float64 and for a
    strided view (the result written back through the view); read-only arrays and objects that
    are not arrays are refused before the step."""
    from gradwire._arrays import in_place_f32

    name, g = sorted(grads_step1.items())[0]
    a = np.array(g, dtype=np.float32)
    flat, shape, write_back = in_place_f32(a)
    assert np.shares_memory(flat, a) and write_back is None and shape == a.shape
    flat, _, write_back = in_place_f32(a.astype(np.float64))
    assert write_back is not None

    method = "topk k=ratio:0.01 values=int8:256"
    apart = gradwire.AllReduce(method, _AloneCommunicator())
    expected = apart.all_reduce(grads_step1)
    wide = {k: np.array(v, dtype=np.float64) for k, v in grads_step1.items()}
    gradwire.AllReduce(method, _AloneCommunicator()).all_reduce_(wide)
    for k, v in wide.items():
        assert v.dtype == np.float64
        assert v.astype(np.float32).tobytes() == expected[k].tobytes(), k

    strided = {}
    for k, v in grads_step1.items():
        holder = np.zeros(np.shape(v) + (2,), dtype=np.float32)
        holder[..., 1] = v
        strided[k] = holder[..., 1]
    assert not all(v.flags.c_contiguous for v in strided.values())
    gradwire.AllReduce(method, _AloneCommunicator()).all_reduce_(strided)
    for k, v in strided.items():
        assert np.ascontiguousarray(v).tobytes() == expected[k].tobytes(), k

    frozen = {k: np.array(v, dtype=np.float32) for k, v in grads_step1.items()}
    next(iter(frozen.values())).flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        gradwire.AllReduce(method, _AloneCommunicator()).all_reduce_(frozen)
    with pytest.raises(TypeError, match="numpy arrays or torch tensors"):
        gradwire.AllReduce(method, _AloneCommunicator()).all_reduce_({name: list(map(float, np.ravel(g)))})


def test_start_in_place_gives_the_blocking_results_and_the_other_methods_wait(grads_step1, grads_step2):
    """`start_` runs a step on the library's thread: `wait` writes the values `all_reduce_`
    writes, bit for bit, with steps in flight; a bucket that does not end the model step leaves
    `step` where it was; every other method first waits for the steps in flight; a handle
    waited for twice is a ValueError."""
    method = "topk k=ratio:0.01 values=int8:256"
    blocking = gradwire.AllReduce(method, _AloneCommunicator())
    want = []
    for g in (grads_step1, grads_step2, grads_step1):
        copies = {n: v.copy() for n, v in g.items()}
        blocking.all_reduce_(copies)
        want.append(copies)
    ar = gradwire.AllReduce(method, _AloneCommunicator())
    got = [{n: v.copy() for n, v in g.items()} for g in (grads_step1, grads_step2, grads_step1)]
    handles = [ar.start_(g) for g in got]
    for g in got:
        # The values were copied in: changing them now does not change the step.
        for v in g.values():
            v.fill(7.0)
    for h in handles:
        assert not h.waited
        h.wait()
        assert h.waited
    for g, w in zip(got, want):
        for n in w:
            assert g[n].tobytes() == w[n].tobytes(), n
    with pytest.raises(ValueError, match="waited for already"):
        handles[0].wait()
    assert ar.step == blocking.step == 3
    # Buckets of one model step: its step number for each, one advance for the step.
    names = sorted(grads_step1)
    first, rest = names[: len(names) // 2], names[len(names) // 2 :]
    a = ar.start_({n: grads_step2[n].copy() for n in first}, ends_step=False)
    # `step` waits for the bucket in flight; it did not end the model step.
    assert ar.step == 3
    b = ar.start_({n: grads_step2[n].copy() for n in rest}, ends_step=True)
    a.wait()
    b.wait()
    assert ar.step == 4
    # A result that does not come back: a gradient with NaN fails at `wait`, as all_reduce_
    # fails, and the next step runs.
    bad = {n: v.copy() for n, v in grads_step1.items()}
    bad[names[0]].reshape(-1)[0] = np.nan
    pending = ar.start_(bad)
    with pytest.raises(ValueError):
        pending.wait()
    ar.start_({n: v.copy() for n, v in grads_step1.items()}).wait()


def test_start_reuses_the_buffers_of_steps_waited_for_and_results_stay_the_blocking_ones():
    """`start_` copies each array into the buffer of the step waited for before under that
    name (no model-sized allocation a step): the results stay `all_reduce_`'s, bit for bit,
    when a name comes back with another shape of the same length or with another length, and
    after a step that failed."""
    method = "topk k=ratio:0.25 values=f32"  # no error feedback: shapes may change
    blocking = gradwire.AllReduce(method, _AloneCommunicator(), error_feedback=False)
    ar = gradwire.AllReduce(method, _AloneCommunicator(), error_feedback=False)
    rng = np.random.default_rng(3)
    for shape in [(6, 4), (6, 4), (4, 6), (5, 5), (24,), (24,)]:
        g = {"w": rng.standard_normal(shape).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
        want = {n: v.copy() for n, v in g.items()}
        blocking.all_reduce_(want)
        got = {n: v.copy() for n, v in g.items()}
        ar.start_(got).wait()
        for n in g:
            assert got[n].shape == shape if n == "w" else got[n].shape == (3,)
            assert got[n].tobytes() == want[n].tobytes(), (shape, n)
        if shape == (5, 5):
            bad = {n: v.copy() for n, v in g.items()}
            bad["w"][0, 0] = np.nan
            with pytest.raises(ValueError):
                ar.start_(bad).wait()
            with pytest.raises(ValueError):
                blocking.all_reduce_(bad)
