"""Torch tensors in and out (the CI stage installs torch, so these run there)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradwire  # noqa: E402
from gradwire import reference  # noqa: E402


def test_reference_on_torch_matches_numpy(grads_step1):
    tg = {n: torch.from_numpy(g.copy()) for n, g in grads_step1.items()}
    r_np, r_t = {}, {}
    p_np = reference.compress(grads_step1, "topk-int8", 0.01, r_np)
    p_t = reference.compress(tg, "topk-int8", 0.01, r_t)
    assert sorted(p_np) == sorted(p_t)
    for key in p_np:
        assert isinstance(p_t[key], torch.Tensor)
        np.testing.assert_array_equal(p_t[key].numpy(), p_np[key])
    assert p_t[next(iter(grads_step1)) + "::idx"].dtype == torch.int64
    for name in r_np:
        assert isinstance(r_t[name], torch.Tensor) and r_t[name].shape == tg[name].shape
        np.testing.assert_array_equal(r_t[name].numpy(), r_np[name])
    shapes = {n: t.shape for n, t in tg.items()}
    dense = reference.decompress(p_t, shapes, "topk-int8")
    for name in shapes:
        assert isinstance(dense[name], torch.Tensor) and dense[name].dtype == torch.float32
        assert dense[name].shape == shapes[name]
    # A second step reads the torch residuals back.
    reference.compress(tg, "topk-int8", 0.01, r_t)
    reference.compress(grads_step1, "topk-int8", 0.01, r_np)
    for name in r_np:
        np.testing.assert_array_equal(r_t[name].numpy(), r_np[name])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_are_converted_to_float32(dtype):
    g = torch.linspace(-1, 1, 64).to(dtype).reshape(8, 8)
    p = reference.compress({"w": g}, "topk", 0.25)
    want = reference.compress({"w": g.to(torch.float32).numpy()}, "topk", 0.25)
    np.testing.assert_array_equal(p["w::val"].numpy(), want["w::val"])
    assert p["w::val"].dtype == torch.float32


def test_non_contiguous_tensors():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = base.t()
    assert not t.is_contiguous()
    p = reference.compress({"w": t}, "topk", 0.25)
    want = reference.compress({"w": np.ascontiguousarray(t.numpy())}, "topk", 0.25)
    np.testing.assert_array_equal(p["w::idx"].numpy(), want["w::idx"])


def test_compressor_on_torch(grads_step1):
    tg = {n: torch.from_numpy(g.copy()) for n, g in grads_step1.items()}
    a = gradwire.Compressor("topk k=ratio:0.01 values=int8:256")
    b = gradwire.Compressor("topk k=ratio:0.01 values=int8:256")
    assert a.compress(tg) == b.compress(grads_step1)
    out = a.decompress(b.compress(grads_step1), as_torch=True)
    for name, t in tg.items():
        assert isinstance(out[name], torch.Tensor) and out[name].shape == t.shape
    res = a.residuals(as_torch=True)
    assert all(isinstance(r, torch.Tensor) for r in res.values())


def test_nan_in_a_torch_gradient():
    g = torch.ones(10)
    g[3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        reference.compress({"w": g}, "topk", 0.5, {})


from test_compressor import _AloneCommunicator as _Alone  # noqa: E402  (a group of one)


def test_all_reduce_in_place_writes_torch_tensors_where_they_are(grads_step1):
    """float32 tensors are overwritten in place (their storage keeps its address); float16 and
    bfloat16 tensors get the result rounded to their dtype through one copy each way; tensors
    that share memory are refused before anything is written."""
    method = "topk k=ratio:0.01 values=int8:256"
    expected = gradwire.AllReduce(method, _Alone()).all_reduce(grads_step1)
    tensors = {n: torch.from_numpy(g.copy()) for n, g in grads_step1.items()}
    addresses = {n: t.data_ptr() for n, t in tensors.items()}
    gradwire.AllReduce(method, _Alone()).all_reduce_(tensors)
    for n, t in tensors.items():
        assert t.data_ptr() == addresses[n]
        assert t.numpy().tobytes() == expected[n].tobytes(), n
    for dtype in (torch.float16, torch.bfloat16):
        half = {n: torch.from_numpy(g.copy()).to(dtype) for n, g in grads_step1.items()}
        want = gradwire.AllReduce(method, _Alone()).all_reduce(
            {n: t.to(torch.float32) for n, t in half.items()}
        )
        gradwire.AllReduce(method, _Alone()).all_reduce_(half)
        for n, t in half.items():
            assert t.dtype == dtype
            assert torch.equal(t, torch.from_numpy(want[n]).to(dtype)), n

    bucket = torch.zeros(100)
    for overlapping in ({"a": bucket[:60], "b": bucket[40:]}, {"a": bucket, "b": bucket}):
        with pytest.raises(ValueError, match="share memory"):
            gradwire.AllReduce("dense values=f32", _Alone(), error_feedback=False).all_reduce_(
                overlapping
            )
    assert torch.count_nonzero(bucket) == 0


def test_hook_state_sets_skip_non_finite_unless_the_all_reduce_chose():
    import gradwire.torch as gwt

    model = torch.nn.Linear(4, 2)
    method = "topk k=ratio:0.5 values=int8:256"
    default = gradwire.AllReduce(method, _Alone())
    assert not default.skip_non_finite
    gwt.HookState(model, default)
    assert default.skip_non_finite
    chosen = gradwire.AllReduce(method, _Alone(), skip_non_finite=False)
    gwt.HookState(model, chosen)
    assert not chosen.skip_non_finite
    gwt.HookState(model, chosen, skip_non_finite=True)
    assert chosen.skip_non_finite
    # A skipped step in a group of one: NaN results, the step not advanced.
    g = {"w": torch.ones(4, 2), "b": torch.tensor([1.0, float("inf")])}
    chosen.all_reduce_(g)
    assert chosen.last_step_skipped and chosen.step == 0
    assert all(torch.isnan(t).all() for t in g.values())


def test_scale_residuals_refuses_factors_it_cannot_apply():
    ar = gradwire.AllReduce("topk k=ratio:0.5 values=int8:256", _Alone())
    for bad in [0.0, -2.0, float("nan"), float("inf"), 1e-50, 1e50]:
        with pytest.raises(ValueError, match="scaled by"):
            ar.scale_residuals(bad)
    with pytest.raises(TypeError):
        ar.scale_residuals("2")
    ar.scale_residuals(2.0)


def test_start_in_place_writes_torch_tensors_of_every_dtype(grads_step1):
    """`start_` on float32 tensors writes the results where they are at `wait`; float16 and
    bfloat16 tensors get them rounded to their dtype, as `all_reduce_` writes them."""
    method = "topk k=ratio:0.01 values=int8:256"
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        want = {n: torch.from_numpy(g.copy()).to(dtype) for n, g in grads_step1.items()}
        gradwire.AllReduce(method, _Alone()).all_reduce_(want)
        got = {n: torch.from_numpy(g.copy()).to(dtype) for n, g in grads_step1.items()}
        addresses = {n: t.data_ptr() for n, t in got.items()}
        gradwire.AllReduce(method, _Alone()).start_(got).wait()
        for n, t in got.items():
            assert t.dtype == dtype and t.data_ptr() == addresses[n]
            assert torch.equal(t, want[n]), (dtype, n)


def test_overlapped_hook_refuses_what_it_cannot_run():
    """`HookState(..., overlap=True)` needs the all-gather, a process group of the all-reduce's
    own, and, delayed, no skipping of non-finite steps: each is a ValueError naming it."""
    import gradwire.torch as gwt

    model = torch.nn.Linear(4, 2)
    method = "topk k=ratio:0.5 values=int8:256"

    class OnDefaultGroup(_Alone):
        group = None  # as TorchDistributed() on the default group

    with pytest.raises(ValueError, match="allgather"):
        gwt.HookState(model, gradwire.AllReduce(method, _Alone(), collective="two-phase"), overlap=True)
    with pytest.raises(ValueError, match="group of its own"):
        gwt.HookState(model, gradwire.AllReduce(method, OnDefaultGroup()), overlap=True)

    class OnDdpGroup(_Alone):
        group = object()  # the group DDP was given

    class DdpLike(torch.nn.Linear):
        process_group = OnDdpGroup.group

    with pytest.raises(ValueError, match="group of its own"):
        gwt.HookState(DdpLike(4, 2), gradwire.AllReduce(method, OnDdpGroup()), overlap=True)
    # Mixed precision: the overlapped hook skips non-finite steps as the blocking one does (on
    # by default); the delayed hook refuses to (its verdict would come a step late).
    state = gwt.HookState(model, gradwire.AllReduce(method, _Alone()), overlap=True)
    assert state.overlap and state.allreduce.skip_non_finite
    chosen = gwt.HookState(model, gradwire.AllReduce(method, _Alone(), skip_non_finite=False), overlap=True)
    assert not chosen.allreduce.skip_non_finite
    with pytest.raises(ValueError, match="non-finite"):
        gwt.HookState(model, gradwire.AllReduce(method, _Alone(), skip_non_finite=True), delay=True)
    with pytest.raises(ValueError, match="non-finite"):
        gwt.HookState(model, gradwire.AllReduce(method, _Alone()), delay=True, skip_non_finite=True)
    state = gwt.HookState(model, gradwire.AllReduce(method, _Alone()), delay=True)
    assert state.overlap and not state.allreduce.skip_non_finite
