"""gradwire.comm.Mpi4py: 3 ranks under mpirun (Open MPI), the same rules as over
torch.distributed: bit-identical results, every rank fails alike."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("mpi4py")

from conftest import expected_dense_mean  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent


def test_all_reduce_over_mpi4py(tmp_path):
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun is needed (libopenmpi-dev openmpi-bin)"
    w = 3
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(w), sys.executable,
           str(HERE / "mpi_worker.py"), str(tmp_path)]
    env = dict(os.environ, OMPI_MCA_btl="self,tcp", OMPI_MCA_btl_tcp_if_include="lo",
               OMPI_MCA_oob_tcp_if_include="lo", RAYON_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, timeout=240, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(w)]
    for r in res[1:]:
        for key in ("dense", "allgather", "two-phase", "after"):
            assert r[key] == res[0][key], key
    want = expected_dense_mean(w, (40, 30), 333)
    for k, v in want.items():
        got = np.frombuffer(bytes.fromhex(res[0]["dense"][k]), dtype=np.float32)
        np.testing.assert_allclose(got, v, rtol=1e-5, atol=1e-6)
    assert res[1]["fault"][0] == "ValueError"
    for r in (res[0], res[2]):
        assert r["fault"][0] == "GradwireError" and "rank 1" in r["fault"][1], r["fault"]
    # The two-phase collective moves fewer bytes per rank than the all-gather's W - 1 bundles
    # only at larger W; here both ran, and both counted their traffic.
    assert res[0]["allgather_traffic"][1] > 0 and res[0]["two-phase_traffic"][1] > 0
