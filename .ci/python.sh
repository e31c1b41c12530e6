#!/usr/bin/env bash
# The Python package (issue 28): builds the wheel with maturin, installs it with its test
# dependencies (numpy, pytest, torch, scikit-learn) into a virtual environment, runs the pytest suite. Fails,
# saying why, when Python 3.9+, pip or a package index is missing; never skips the torch tests
# (it checks that torch, scikit-learn and mpi4py import before running them). pip's cache keeps torch between runs.
set -euo pipefail
cd "$(dirname "$0")/../bindings/python"

if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 9))' 2>/dev/null; then
    echo "python: FAILED: python3 >= 3.9 is needed"
    exit 1
fi
venv="$PWD/target/venv"
python3 -m venv "$venv" || { echo "python: FAILED: python3 -m venv"; exit 1; }
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$py" -m pip install -q "maturin>=1.5,<2" "numpy>=1.21" "pytest>=7" ||
    { echo "python: FAILED: pip could not install maturin, numpy, pytest"; exit 1; }
"$py" -m pip install -q mpi4py ||
    { echo "python: FAILED: pip could not install mpi4py (it needs Open MPI: .ci/install-mpi.sh)"; exit 1; }
"$py" -m pip install -q torch scikit-learn ||
    { echo "python: FAILED: pip could not install torch and scikit-learn (the DDP example's digits)"; exit 1; }
# The crate is outside the workspace, so the main fmt and clippy stages do not see it.
cargo fmt --check
cargo clippy --release --all-targets -- -D warnings
rm -rf dist
"$venv/bin/maturin" build --release -o dist
"$py" -m pip install -q --force-reinstall --no-deps dist/gradwire-*.whl
"$py" -c 'import torch, sklearn, mpi4py, gradwire; print("python: gradwire", gradwire.__version__, "torch", torch.__version__)'
# From the tests' folder, so that the installed wheel is imported, not python/ of the checkout.
cd tests
"$py" -m pytest -q -p no:cacheprovider .
