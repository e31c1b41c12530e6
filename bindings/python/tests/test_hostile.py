"""Bad input and hostile payloads: a clear Python exception, never a crash, never a partial
result."""

import math

import numpy as np
import pytest

import gradwire
from gradwire import reference

SHAPES = {"w": (2, 3)}


def good_payload(mode="topk-int8"):
    g = {"w": np.array([[0.5, -3.0, 0.25], [2.0, 0.0, -1.0]], dtype=np.float32)}
    return reference.compress(g, mode, 0.5)


def test_unknown_mode():
    with pytest.raises(ValueError, match="unknown compression mode"):
        reference.compress({"w": np.ones(3, np.float32)}, "topk8", 0.1)
    with pytest.raises(ValueError, match="unknown compression mode"):
        reference.decompress({}, SHAPES, "bogus")


@pytest.mark.parametrize("ratio", [float("nan"), float("inf"), -0.5])
def test_bad_ratio(ratio):
    with pytest.raises(ValueError, match="ratio"):
        reference.compress({"w": np.ones(3, np.float32)}, "topk", ratio)


def test_nan_gradient_raises_and_changes_nothing():
    residual = {"a": np.ones(4, np.float32)}
    before = residual["a"].copy()
    g = {"a": np.ones(4, np.float32), "b": np.array([1.0, math.nan], np.float32)}
    with pytest.raises(ValueError, match="NaN or infinite"):
        reference.compress(g, "topk", 0.5, residual)
    np.testing.assert_array_equal(residual["a"], before)
    assert "b" not in residual


def test_residual_of_another_size():
    with pytest.raises(ValueError, match="elements"):
        reference.compress({"a": np.ones(4, np.float32)}, "topk", 0.5, {"a": np.ones(5, np.float32)})


def test_reserved_name():
    with pytest.raises(ValueError, match="invalid tensor name"):
        reference.compress({"a::idx": np.ones(4, np.float32)}, "topk", 0.5)


def test_missing_and_unexpected_keys():
    p = good_payload()
    del p["w::scale"]
    with pytest.raises(gradwire.PayloadError, match="no key"):
        reference.decompress(p, SHAPES, "topk-int8")
    p = good_payload()
    p["x::idx"] = np.array([0], np.int64)
    with pytest.raises(gradwire.PayloadError, match="unexpected key"):
        reference.decompress(p, SHAPES, "topk-int8")


def test_bad_indices():
    p = good_payload("topk")
    p["w::idx"] = np.array([0, 0, 1], np.int64)
    with pytest.raises(gradwire.PayloadError, match="more than once"):
        reference.decompress(p, SHAPES, "topk")
    p = good_payload("topk")
    p["w::idx"] = np.array([0, 6, 1], np.int64)
    with pytest.raises(gradwire.PayloadError, match="out of range"):
        reference.decompress(p, SHAPES, "topk")
    p = good_payload("topk")
    p["w::idx"] = np.array([0, -1, 1], np.int64)
    with pytest.raises(gradwire.PayloadError, match="out of range"):
        reference.decompress(p, SHAPES, "topk")
    p = good_payload("topk")
    p["w::idx"] = np.array([0, 1], np.int64)
    with pytest.raises(gradwire.PayloadError, match="indices but"):
        reference.decompress(p, SHAPES, "topk")


def test_int32_indices_are_widened_and_checked():
    p = good_payload("topk")
    want = reference.decompress(p, SHAPES, "topk")
    p["w::idx"] = p["w::idx"].astype(np.int32)
    got = reference.decompress(p, SHAPES, "topk")
    np.testing.assert_array_equal(got["w"], want["w"])
    p["w::idx"] = np.array([0, 9, 1], np.int32)
    with pytest.raises(gradwire.PayloadError, match="out of range"):
        reference.decompress(p, SHAPES, "topk")


def test_scalar_scale_is_accepted():
    p = good_payload()
    want = reference.decompress(p, SHAPES, "topk-int8")
    p["w::scale"] = p["w::scale"].reshape(())
    got = reference.decompress(p, SHAPES, "topk-int8")
    np.testing.assert_array_equal(got["w"], want["w"])


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan])
def test_bad_scale(scale):
    p = good_payload()
    p["w::scale"] = np.array([scale], np.float32)
    with pytest.raises(gradwire.PayloadError, match="scale"):
        reference.decompress(p, SHAPES, "topk-int8")


def test_bad_values():
    p = good_payload()
    p["w::val"] = np.array([-128, 1, 2], np.int8)
    with pytest.raises(gradwire.PayloadError, match="-128"):
        reference.decompress(p, SHAPES, "topk-int8")
    p = good_payload("topk")
    p["w::val"] = np.array([1.0, math.nan, 2.0], np.float32)
    with pytest.raises(gradwire.PayloadError, match="NaN"):
        reference.decompress(p, SHAPES, "topk")
    p = good_payload("topk")
    p["w::val"] = p["w::val"].astype(np.float16)
    with pytest.raises(gradwire.PayloadError, match="float16"):
        reference.decompress(p, SHAPES, "topk")
    p = good_payload("topk")
    p["w::val"] = p["w::val"].astype(np.int8)
    with pytest.raises(gradwire.PayloadError, match="dtype"):
        reference.decompress(p, SHAPES, "topk")


def test_truncated_and_garbage_bytes():
    raw = reference.to_bytes(good_payload())
    for cut in range(0, len(raw) - 1, 7):
        with pytest.raises(gradwire.PayloadError):
            reference.decompress(raw[:cut], SHAPES, "topk-int8")
    with pytest.raises(gradwire.PayloadError):
        reference.decompress(b"\xff" * 64, SHAPES, "topk-int8")
    # A header that claims a huge length: refused without allocating it.
    with pytest.raises(gradwire.PayloadError):
        reference.decompress((1 << 62).to_bytes(8, "little") + b"{}", SHAPES, "topk-int8")


def test_every_byte_flip_is_refused_or_decodes_to_finite_values():
    raw = bytearray(reference.to_bytes(good_payload()))
    for i in range(len(raw)):
        for bit in (0x01, 0x80):
            damaged = bytearray(raw)
            damaged[i] ^= bit
            try:
                out = reference.decompress(bytes(damaged), SHAPES, "topk-int8")
            except gradwire.PayloadError:
                continue
            assert np.isfinite(out["w"]).all()


def test_payload_error_is_a_gradwire_error():
    assert issubclass(gradwire.PayloadError, gradwire.GradwireError)
    assert issubclass(gradwire.GradwireError, Exception)
