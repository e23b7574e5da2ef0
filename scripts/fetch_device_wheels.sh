#!/usr/bin/env bash
# Download the wheels the offline GPU check machine needs into .whl/ (git-ignored; carried to the
# machine with the repo, about 25 MB): megatron-core and highspy as pinned by setup.py, the small
# pure-Python packages the checks use, and numpy. CPython 3.12, manylinux x86_64. Never torch: the
# machine has its own CUDA build. Run once with network access:  bash scripts/fetch_device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-$( [ -x .venv/bin/pip ] && echo .venv/bin/pip || echo "python3 -m pip")}
mkdir -p .whl
$PIP download --quiet --only-binary=:all: --no-deps --dest .whl \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any \
  megatron-core==0.19.2 highspy==1.16.0 numpy==2.5.5 pyyaml==6.0.4 psutil==7.2.2 packaging==26.4 \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.19.2
ls -1 .whl
du -sh .whl
