#!/usr/bin/env python3
"""Writes checksums.tsv: per tensor of the reference runs' `_dense` and `_residual` files,
the CRC-32 (zlib, as `crc32fast` computes it) of its little-endian f32 bytes, its element
count and its count of non-zero entries. Standard library only.

Usage: python3 checksums.py /work/shared/data > checksums.tsv
"""
import json
import struct
import sys
import zlib

RUNS = ["ref_topk_0.01_step1", "ref_topk_0.1_step1", "ref_topk-int8_0.01_step1"]


def tensors(path):
    with open(path, "rb") as f:
        b = f.read()
    (n,) = struct.unpack("<Q", b[:8])
    header = json.loads(b[8 : 8 + n])
    base = 8 + n
    for name in sorted(k for k in header if k != "__metadata__"):
        info = header[name]
        assert info["dtype"] == "F32", (path, name)
        start, end = info["data_offsets"]
        yield name, info["shape"], b[base + start : base + end]


def main(data_dir):
    print("# file\ttensor\tshape\tn\tnonzero\tcrc32")
    for run in RUNS:
        for kind in ("dense", "residual"):
            fname = f"{run}_{kind}.safetensors"
            for name, shape, data in tensors(f"{data_dir}/{fname}"):
                count = len(data) // 4
                values = struct.unpack(f"<{count}f", data)
                nonzero = sum(1 for v in values if v != 0.0)
                shape_s = "x".join(str(d) for d in shape)
                print(f"{fname}\t{name}\t{shape_s}\t{count}\t{nonzero}\t{zlib.crc32(data):08x}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/work/shared/data")
