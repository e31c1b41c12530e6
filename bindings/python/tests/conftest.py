"""Shared helpers: the repository's test data (no test reads ../shared or the network)."""

import json
import pathlib
import struct
import zlib

import numpy as np
import pytest

TESTDATA = pathlib.Path(__file__).resolve().parents[3] / "testdata"

DTYPES = {"F32": np.float32, "I64": np.int64, "I8": np.int8, "F16": np.float16}


def read_safetensors(path):
    """``{name: numpy array}`` of a safetensors file (a test helper, not the library's reader)."""
    b = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    header = json.loads(b[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        a = np.frombuffer(b[base + start : base + end], dtype=DTYPES[info["dtype"]])
        out[name] = a.reshape(info["shape"]).copy()
    return out


def checksums():
    """``{(file, tensor): (shape, n, nonzero, crc32)}`` from testdata/reference/checksums.tsv."""
    rows = {}
    for line in (TESTDATA / "reference" / "checksums.tsv").read_text().splitlines():
        if line.startswith("#"):
            continue
        file, tensor, shape, n, nonzero, crc = line.split("\t")
        dims = tuple(int(d) for d in shape.split("x")) if shape else ()
        rows[(file, tensor)] = (dims, int(n), int(nonzero), int(crc, 16))
    return rows


def crc32_f32(a):
    """CRC-32 of an array's little-endian float32 bytes (as checksums.tsv records it)."""
    return zlib.crc32(np.ascontiguousarray(a, dtype="<f4").tobytes())


@pytest.fixture(scope="session")
def grads_step1():
    return read_safetensors(TESTDATA / "minilm_small_grads.safetensors")


@pytest.fixture(scope="session")
def grads_step2():
    return read_safetensors(TESTDATA / "minilm_small_grads_step2.safetensors")


def seeded_grads(rank, a_shape, b_len):
    """Rank ``rank``'s gradients in the dense-sum tests (the workers draw the same)."""
    rng = np.random.default_rng(rank)
    return {"a": rng.standard_normal(a_shape).astype(np.float32), "b": rng.standard_normal(b_len).astype(np.float32)}


def expected_dense_mean(world_size, a_shape, b_len):
    """The mean of every rank's :func:`seeded_grads`, flat, summed in rank order."""
    total = {}
    for rank in range(world_size):
        for k, v in seeded_grads(rank, a_shape, b_len).items():
            total[k] = v.reshape(-1) if k not in total else total[k] + v.reshape(-1)
    return {k: v / world_size for k, v in total.items()}
