"""One rank of test_mpi4py.py (started by mpirun): gradwire.AllReduce over gradwire.comm.Mpi4py;
writes what it saw to OUT/rank{R}.json."""

import hashlib
import json
import math
import os
import sys

import numpy as np

import gradwire
from conftest import seeded_grads
from gradwire.comm import Mpi4py


def main(out):
    t = Mpi4py()
    rank, w = t.rank, t.world_size
    g = seeded_grads(rank, (40, 30), 333)
    res = {"rank": rank}
    dense = gradwire.AllReduce("dense values=f32", t, error_feedback=False).all_reduce(g)
    res["dense"] = {k: v.tobytes().hex() for k, v in dense.items()}
    for collective in ("allgather", "two-phase"):
        ar = gradwire.AllReduce("topk k=ratio:0.05 values=int8:256", t, seed=9, collective=collective)
        res[collective] = [hashlib.sha256(b"".join(v.tobytes() for _, v in sorted(ar.all_reduce(g).items()))).hexdigest() for _ in range(3)]
        res[collective + "_traffic"] = list(ar.traffic)
    ar = gradwire.AllReduce("sign scale=mean-abs:1024", t)
    bad = {k: v.copy() for k, v in g.items()}
    if rank == 1:
        bad["b"][5] = math.inf
    try:
        ar.all_reduce(bad)
        res["fault"] = ["ok", ""]
    except Exception as e:
        res["fault"] = [type(e).__name__, str(e)]
    res["after"] = hashlib.sha256(ar.all_reduce(g)["a"].tobytes()).hexdigest()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
