"""gradwire.reference against the reference Python module's stored results on the real MiniLM
gradients (testdata/reference: its payloads, and checksums of its dense and residual files)."""

import numpy as np
import pytest

import gradwire
from gradwire import reference

from conftest import TESTDATA, checksums, crc32_f32, read_safetensors

RUNS = [("topk", 0.01), ("topk", 0.1), ("topk-int8", 0.01)]


def run_name(mode, ratio):
    return f"ref_{mode}_{ratio}_step1"


@pytest.mark.parametrize("mode,ratio", RUNS)
def test_step1_payload_matches_the_reference(grads_step1, mode, ratio):
    stored = read_safetensors(TESTDATA / "reference" / f"{run_name(mode, ratio)}.safetensors")
    residual = {}
    ours = reference.compress(grads_step1, mode, ratio, residual)
    assert sorted(ours) == sorted(stored)
    for key, want in stored.items():
        assert ours[key].dtype == want.dtype, key
        assert ours[key].shape == want.shape, key
    for name, g in grads_step1.items():
        k = reference.topk_count(g.size, ratio)
        idx = ours[name + "::idx"]
        assert idx.shape == (k,)
        order = np.argsort(stored[name + "::idx"])
        np.testing.assert_array_equal(idx, stored[name + "::idx"][order])
        np.testing.assert_array_equal(ours[name + "::val"], stored[name + "::val"][order])
        if mode == "topk-int8":
            assert ours[name + "::scale"].tobytes() == stored[name + "::scale"].tobytes()


@pytest.mark.parametrize("mode,ratio", RUNS)
def test_step1_residual_matches_the_reference(grads_step1, mode, ratio):
    rows = checksums()
    residual = {}
    payload = reference.compress(grads_step1, mode, ratio, residual)
    file = f"{run_name(mode, ratio)}_residual.safetensors"
    for name, g in grads_step1.items():
        shape, n, nonzero, crc = rows[(file, name)]
        r = residual[name]
        assert r.shape == g.shape == shape and r.dtype == np.float32
        idx = payload[name + "::idx"]
        if mode == "topk":
            assert crc32_f32(r) == crc, name
            continue
        # int8: the reference zeroes the kept entries (losing the rounding error); gradwire
        # keeps exactly x - code * scale there (x = g: the residual started empty).
        flat = r.reshape(-1)
        scale = payload[name + "::scale"][0]
        sent = payload[name + "::val"].astype(np.float32) * scale
        np.testing.assert_array_equal(flat[idx], g.reshape(-1)[idx] - sent)
        zeroed = flat.copy()
        zeroed[idx] = 0.0
        assert crc32_f32(zeroed) == crc, name


@pytest.mark.parametrize("mode,ratio", RUNS)
def test_decompress_of_the_stored_payload_matches_the_reference(grads_step1, mode, ratio):
    rows = checksums()
    stored = read_safetensors(TESTDATA / "reference" / f"{run_name(mode, ratio)}.safetensors")
    shapes = {name: g.shape for name, g in grads_step1.items()}
    dense = reference.decompress(stored, shapes, mode)
    raw = (TESTDATA / "reference" / f"{run_name(mode, ratio)}.safetensors").read_bytes()
    from_bytes = reference.decompress(raw, shapes, mode)
    file = f"{run_name(mode, ratio)}_dense.safetensors"
    for name in shapes:
        shape, n, nonzero, crc = rows[(file, name)]
        assert dense[name].shape == shape and dense[name].dtype == np.float32
        assert crc32_f32(dense[name]) == crc, name
        assert np.count_nonzero(dense[name]) == nonzero
        np.testing.assert_array_equal(from_bytes[name], dense[name])


@pytest.mark.parametrize("mode,ratio", RUNS)
def test_step2_is_consistent(grads_step1, grads_step2, mode, ratio):
    residual = {}
    reference.compress(grads_step1, mode, ratio, residual)
    old = {n: r.copy() for n, r in residual.items()}
    payload = reference.compress(grads_step2, mode, ratio, residual)
    shapes = {n: g.shape for n, g in grads_step2.items()}
    dense = reference.decompress(payload, shapes, mode)
    for name, g in grads_step2.items():
        x = (g + old[name]).reshape(-1)
        k = reference.topk_count(x.size, ratio)
        idx = payload[name + "::idx"]
        assert idx.shape == (k,) and np.all(np.diff(idx) > 0)
        # The kept set is a top-k of x: nothing dropped is larger than anything kept.
        kept = np.zeros(x.size, dtype=bool)
        kept[idx] = True
        if (~kept).any():
            assert np.abs(x[~kept]).max() <= np.abs(x[kept]).min()
        # Nothing lost: sent + new residual == gradient + old residual, per coordinate.
        sent = dense[name].reshape(-1)
        new = residual[name].reshape(-1)
        np.testing.assert_array_equal(new[~kept], x[~kept])
        np.testing.assert_array_equal(sent[~kept], 0.0)
        np.testing.assert_array_equal(sent[kept] + new[kept], x[kept])


def test_without_residual_matches_a_fresh_residual(grads_step1):
    a = reference.compress(grads_step1, "topk-int8", 0.01)
    b = reference.compress(grads_step1, "topk-int8", 0.01, {})
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_mode_none_passes_tensors_through():
    g = {"w": np.ones((2, 3), dtype=np.float32)}
    residual = {"w": np.full((2, 3), 5.0, dtype=np.float32)}
    out = reference.compress(g, "none", 0.01, residual)
    assert out == g and out is not g
    assert residual["w"][0, 0] == 5.0
    assert reference.decompress(out, {"w": (2, 3)}, "none") == out


def test_payload_bytes_and_report(grads_step1):
    wire = reference.compress(grads_step1, "topk-int8", 0.01)
    d, w, ratio = reference.compression_report(grads_step1, wire)
    assert d == sum(g.size * 4 for g in grads_step1.values())
    assert w == sum(a.size * a.itemsize for a in wire.values())
    assert ratio == d / w
    assert reference.payload_bytes({}) == 0
    assert reference.compression_report({}, {}) == (0, 0, 1.0)


def test_topk_count():
    assert reference.topk_count(1000, 0.01) == 10
    assert reference.topk_count(50, 0.01) == 1
    assert reference.topk_count(7, 1.5) == 7
    assert reference.topk_count(0, 0.5) == 0
    with pytest.raises(ValueError):
        reference.topk_count(10, float("nan"))


def test_to_bytes_round_trips(grads_step1):
    payload = reference.compress(grads_step1, "topk-int8", 0.01)
    shapes = {n: g.shape for n, g in grads_step1.items()}
    raw = reference.to_bytes(payload)
    a = reference.decompress(raw, shapes, "topk-int8")
    b = reference.decompress(payload, shapes, "topk-int8")
    for name in shapes:
        np.testing.assert_array_equal(a[name], b[name])
