"""gradwire over torch.distributed (gloo on CPU): 2 and 4 processes, the DDP comm hook, the
function after backward, faults on one rank, the dense sum and the two-phase collective."""

import json
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.multiprocessing as mp  # noqa: E402

import dist_workers  # noqa: E402
from conftest import expected_dense_mean  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn, world_size, tmp_path, *args):
    mp.start_processes(fn, args=(world_size, free_port(), str(tmp_path)) + args, nprocs=world_size,
                       join=True, start_method="spawn")
    results = []
    for r in range(world_size):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "error" not in res, res.get("trace")
        results.append(res)
    return results


def check_training(results, steps):
    for r in results[1:]:
        assert r["digests"] == results[0]["digests"], "ranks' parameters differ"
    losses = results[0]["losses"]
    assert len(losses) == steps
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("world_size", [2, 4])
def test_hook_trains_bit_identically(tmp_path, world_size):
    steps = 25
    res = launch(dist_workers.train, world_size, tmp_path, "hook", "topk k=ratio:0.05 values=int8:256",
                 steps, "allgather", "float32", False, False)
    check_training(res, steps)
    r = res[0]
    assert r["step"] == steps  # one all-reduce per step, however many buckets
    assert r["bundle"] < r["dense"] / 5


def test_function_after_backward_and_two_phase(tmp_path):
    steps = 20
    res = launch(dist_workers.train, 4, tmp_path, "function", "sign scale=mean-abs:1024", steps,
                 "two-phase", "float32", False, False)
    check_training(res, steps)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_hook_with_bucket_views_accumulation_and_half_buckets(tmp_path, dtype):
    steps = 20
    res = launch(dist_workers.train, 2, tmp_path, "hook", "topk k=ratio:0.1 values=f32", steps,
                 "allgather", dtype, True, True)
    check_training(res, steps)


def test_compressed_hook_is_close_to_plain_ddp(tmp_path):
    steps = 25
    plain = launch(dist_workers.train, 2, tmp_path, "ddp", "dense values=f32", steps, "allgather",
                   "float32", False, False)
    (tmp_path / "hook").mkdir()
    hooked = launch(dist_workers.train, 2, tmp_path / "hook", "hook", "dense values=f32", steps,
                    "allgather", "float32", False, False)
    # The dense rank-order mean against DDP's own all-reduce: the same up to f32 rounding.
    np.testing.assert_allclose(hooked[0]["losses"], plain[0]["losses"], rtol=1e-4)


def test_faults_fail_every_rank_at_the_same_call(tmp_path):
    res = launch(dist_workers.faults, 4, tmp_path)
    labels = [s[0] for s in res[0]["steps"]]
    assert labels == ["clean", "nan on rank 1", "after", "shape on rank 1", "after shape",
                      "ratio on last rank", "final", "damaged bundle from rank 2", "after damage"]
    for r in res:
        outcome = {label: (kind, msg) for label, kind, msg in r["steps"]}
        assert outcome["clean"][0] == outcome["after"][0] == outcome["after shape"][0] == "ok"
        assert outcome["final"][0] == "ok"
        nan_kind, nan_msg = outcome["nan on rank 1"]
        if r["rank"] == 1:
            assert nan_kind == "ValueError" and "NaN" in nan_msg
        else:
            assert nan_kind == "GradwireError" and "rank 1 could not take part" in nan_msg, nan_msg
        shape_kind, shape_msg = outcome["shape on rank 1"]
        if r["rank"] == 1:
            assert shape_kind == "ValueError" and "shape" in shape_msg, shape_msg
        else:
            assert shape_kind == "GradwireError" and "rank 1" in shape_msg, shape_msg
        kind, msg = outcome["ratio on last rank"]
        assert kind == "GradwireError" and "rank 3 is configured differently" in msg, msg
        kind, msg = outcome["damaged bundle from rank 2"]
        assert kind == "PayloadError" and "rank 2" in msg, msg
        assert outcome["after damage"][0] == "ok"


def test_a_transport_error_breaks_the_group_for_every_later_call_and_nothing_aborts(tmp_path):
    """Issue 48 class 3 over gloo: rank 1's raw call raises once. Before, its next raw call
    paired an 8-byte buffer with its peer's 875 inside gloo and the process aborted."""
    res = launch(dist_workers.broken_transport, 2, tmp_path)
    for r in res:
        (first_kind, first), *later = r["steps"]
        assert first_kind == "GradwireError" and "transport failure" in first, first
        for kind, msg in later:
            assert kind == "GradwireError", msg
            assert f"the group is broken: rank {r['rank']}: transport failure" in msg, msg
    assert "the link went down" in res[1]["steps"][0][1]
    assert res[1]["after"] == 0  # the poisoned rank made no raw call after its failure


def test_ranks_at_different_calls_fail_alike_before_any_raw_call_of_their_sizes(tmp_path):
    res = launch(dist_workers.different_calls, 2, tmp_path)
    for r in res:
        assert len(r["steps"]) == 2
        for kind, msg in r["steps"]:
            assert kind == "GradwireError", msg
            assert msg == res[0]["steps"][0][1], msg  # every rank the same error
            assert "configured differently" in msg and "two-phase" in msg, msg
    # Every raw call is one that all ranks make alike: the same kind with the same lengths
    # (each rank's own buffer padded to them), each data call after a 32-byte opening.
    paired = [[(c[0], c[2]) for c in r["calls"]] for r in res]
    assert paired[0] == paired[1], paired
    openings = paired[0][0::2]
    assert openings and all(c == ("all_gather", [32, 32]) for c in openings), openings


@pytest.mark.parametrize("world_size", [2, 4])
def test_dense_sum_and_two_phase_are_the_same_bits_everywhere(tmp_path, world_size):
    res = launch(dist_workers.dense_and_two_phase, world_size, tmp_path)
    for r in res[1:]:
        assert r["dense"] == res[0]["dense"]
        assert r["two_phase"] == res[0]["two_phase"]
    assert res[0]["collective"] == "two-phase"
    # The dense mean: the rank-order sum of every rank's gradient, divided by W.
    want = expected_dense_mean(world_size, (64, 48), 700)
    for k, v in want.items():
        got = np.frombuffer(bytes.fromhex(res[0]["dense"][k]), dtype=np.float32)
        np.testing.assert_allclose(got, v, rtol=1e-5, atol=1e-6)


def test_hook_checkpoint_resumes_bit_identically(tmp_path):
    res = launch(dist_workers.resume, 2, tmp_path)
    for r in res:
        assert r["resumed"] == r["straight"]
        assert r["step"] == 20
    assert res[0]["straight"] == res[1]["straight"]


@pytest.mark.parametrize("dtype, accumulate", [("float32", False), ("float32", True), ("bfloat16", False)])
def test_delayed_hook_hands_out_the_step_before_s_mean_bit_for_bit(tmp_path, dtype, accumulate):
    """`HookState(..., delay=True)`: zeros at step 0, then at step t the blocking all-reduce's
    mean of step t - 1's gradients (replayed after the run), bit for bit, with several
    buckets, under no_sync() accumulation and in bfloat16; the ranks' parameters equal."""
    steps = 12
    res = launch(dist_workers.delayed, 2, tmp_path, dtype, accumulate, steps)
    for r in res:
        assert r["mismatches"] == [], r["mismatches"]
        assert r["step"] == steps
        # Several buckets a step (DDP's first step may hold one: its buckets are rebuilt after it).
        assert max(r["buckets"]) > 1, r["buckets"]
        assert r["digests"] == res[0]["digests"]
    losses = res[0]["losses"]
    assert losses[-1] < 0.9 * losses[0], losses


def test_delayed_hook_a_rank_that_cannot_name_a_bucket_breaks_for_good_and_no_rank_waits(tmp_path):
    """Rank 1 cannot name a bucket's gradients at step 1: its held copy no longer matches its
    peer's, so it raises at step 1 and every later step (restore from a checkpoint); its peer
    raises from step 2 on (the step it took part in with no tensors fails there); no rank
    waits, and no rank goes on with parameters the other does not have."""
    res = launch(dist_workers.hook_faults, 2, tmp_path, "delay")
    r0, r1 = res
    assert r0["raised"][:2] == [None, None], r0["raised"]
    assert all(e is not None for e in r0["raised"][2:]), r0["raised"]
    assert r1["raised"][0] is None and all(e is not None for e in r1["raised"][1:]), r1["raised"]
    assert "no longer match" in r1["raised"][1] and "restore from a checkpoint" in r1["raised"][1]
    assert r0["digests"][0] == r1["digests"][0]


def test_delayed_hook_checkpoint_resumes_bit_for_bit(tmp_path):
    res = launch(dist_workers.resume, 2, tmp_path, True)
    for r in res:
        assert r["resumed"] == r["straight"]
        assert r["step"] == 20
        assert r["mismatched_step"] and "delayed mean of step" in r["mismatched_step"], r
        assert r["other_model"] and "not of this model" in r["other_model"], r
    assert res[0]["straight"] == res[1]["straight"]


def test_delayed_hook_raises_a_step_s_error_one_step_late_on_every_rank(tmp_path):
    res = launch(dist_workers.delayed_faults, 2, tmp_path)
    for r in res:
        raised = r["raised"]
        assert [i for i, e in enumerate(raised) if e is not None] == [3], raised
        # Rank 1's own error (its gradient held the NaN), its peer's naming rank 1.
        if r["rank"] == 1:
            assert "ValueError" in raised[3] and "NaN" in raised[3], raised[3]
        else:
            assert "GradwireError" in raised[3] and "rank 1" in raised[3], raised[3]
        assert r["digests"] == res[0]["digests"]
        assert r["step"] == 6
        # Step 4 hands out step 3's mean, the same on every rank and not zeros.
        assert r["handed"][4] == res[0]["handed"][4] and r["handed"][4][1], r["handed"]


def test_delayed_hook_refuses_a_loss_scaler():
    import torch.nn as nn

    import gradwire
    import gradwire.torch as gwt

    class Group:  # a transport with a process group of its own (not DDP's)
        rank, world_size, group = 0, 1, object()

        def all_gather(self, data, lengths):
            return [bytes(data)]

        def all_to_all(self, send, recv_lengths):
            return [bytes(b) for b in send]

    model = nn.Linear(3, 2)
    ar = gradwire.AllReduce("topk k=ratio:0.5 values=f32", Group())
    with pytest.raises(ValueError, match="loss scaler"):
        gwt.HookState(model, ar, delay=True, scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize(
    "mode,collective,inf_in",
    [
        ("scaler", "allgather", "loss"),
        ("scaler", "two-phase", "loss"),
        # The overlapped hook: the overflow in DDP's last bucket (the first went out before the
        # verdict and gives back), in its first (the later one comes back NaN unsent), or in
        # every bucket.
        ("overlap-scaler", "allgather", "first-layer"),
        ("overlap-scaler", "allgather", "last-layer"),
        ("overlap-scaler", "allgather", "loss"),
    ],
)
def test_grad_scaler_skips_an_overflow_and_residuals_follow_the_scale(tmp_path, mode, collective, inf_in):
    steps, overflow_at = 7, 3
    scaled = launch(dist_workers.grad_scaler, 2, tmp_path, mode, collective, steps, overflow_at, inf_in)
    plain = launch(dist_workers.grad_scaler, 2, tmp_path, "plain", collective, steps, overflow_at)
    for s, p in zip(scaled, plain):
        # The overflow: skipped on every rank, every bucket NaN, the scale halved after it,
        # grown before.
        assert s["skipped"] == [i == overflow_at for i in range(steps)]
        assert s["all_nan_at_overflow"]
        scales = s["scales"]
        assert scales[overflow_at + 1] == scales[overflow_at] / 2, scales
        assert any(b == 2 * a for a, b in zip(scales, scales[1:])), scales
        # Every other step: the plain run's parameters, step counter and, at the end, residuals.
        kept = [d for i, d in enumerate(s["digests"]) if i != overflow_at]
        assert kept == p["digests"]
        assert [c for i, c in enumerate(s["steps"]) if i != overflow_at] == p["steps"]
        assert s["residuals"] == p["residuals"]
    assert scaled[0]["digests"] == scaled[1]["digests"]


@pytest.mark.parametrize("mode", ["strict", "overlap-strict"])
def test_without_skipping_an_overflow_fails_every_rank_naming_the_gradwire_class(tmp_path, mode):
    # Blocking and overlapped hooks alike.
    res = launch(dist_workers.grad_scaler, 2, tmp_path, mode, "allgather", 1, 0)
    # Rank 1's own gradient: ValueError; its peer is told: GradwireError.
    for r, cls in zip(res, ["GradwireError", "ValueError"]):
        assert r["last_error"] == cls, r
        assert f"{cls}: " in r["raised"] and "NaN or infinity" in r["raised"], r["raised"]


def test_steps_started_in_flight_equal_the_blocking_calls(tmp_path):
    """`AllReduce.start_` over torch.distributed (a process group of its own): three buckets
    in flight per model step give the blocking calls' results, bit for bit, and the step
    number advances once per model step."""
    res = launch(dist_workers.non_blocking, 2, tmp_path)
    for r in res:
        assert r["same"]
        assert r["steps"] == [12, 4]


@pytest.mark.parametrize(
    "method,dtype,bucket_view,accumulate",
    [("topk k=ratio:0.05 values=int8:256", "float32", False, False),
     ("topk k=ratio:0.1 values=f32", "bfloat16", True, True)],
)
def test_overlapped_hook_gives_the_blocking_hook_s_parameters_bit_for_bit(tmp_path, method, dtype, bucket_view, accumulate):
    """`HookState(..., overlap=True)`: each bucket's step starts as DDP hands it over (on a
    process group of its own); the parameters after every step are the blocking hook's, bit
    for bit, and the step number advances once per backward pass."""
    steps = 25
    blocking = launch(dist_workers.train, 2, tmp_path, "hook", method, steps, "allgather", dtype,
                      bucket_view, accumulate)
    (tmp_path / "overlap").mkdir()
    overlapped = launch(dist_workers.train, 2, tmp_path / "overlap", "overlap", method, steps,
                        "allgather", dtype, bucket_view, accumulate)
    check_training(overlapped, steps)
    for b, o in zip(blocking, overlapped):
        assert o["digests"] == b["digests"]
        assert o["step"] == b["step"] == steps


@pytest.mark.parametrize("mode", ["overlap", "blocking"])
def test_hook_a_rank_that_cannot_start_a_bucket_still_takes_part(tmp_path, mode):
    res = launch(dist_workers.hook_faults, 2, tmp_path, mode)
    for r, own in zip(res, ["GradwireError", "ValueError"]):
        assert r["raised"][0] is None and r["raised"][2] is None, r["raised"]
        assert r["raised"][1] is not None and f"{own}: " in r["raised"][1], r["raised"][1]
        assert r["errors"] == [None, own, None], r["errors"]
        assert r["step"] == 3
    assert res[0]["digests"] == res[1]["digests"]
    assert res[0]["dropped"] == res[1]["dropped"]
