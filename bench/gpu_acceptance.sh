#!/usr/bin/env bash
# GPU acceptance on a bare device machine, in one call (issue 24):
#
#   bash bench/gpu_acceptance.sh [OUT_DIR]        # OUT_DIR: default $OUT, else bench/results
#
# 1. Installs what the image lacks from a carried wheel folder ($WHEELS, default ./wheels):
#    every *.whl there, --no-index --no-deps, with --prefix (the mpich wheel's lib/ and bin/
#    survive only a --prefix install; --target drops lib/). Make the folder on a machine with
#    a package index (x86-64, CPython 3.12, as the device image):
#      pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d wheels mpich threadpoolctl
#      pip wheel --no-deps -w wheels .                      # pdist itself
#    (mpich's wheel is tagged manylinux_2_28: name that platform, or pip finds no binary wheel.)
#    The image's CuPy, NumPy, ml_dtypes, nvidia-nccl and mpi4py are used as they are.
#    Without the folder, this tree is used (PYTHONPATH) with whatever MPI is installed.
# 2. Prints what it found (CuPy, NCCL, CUDA driver and runtime, device, compute mode,
#    the transport chosen where ranks share the GPU) and runs steps (a)-(e), each launch
#    under its own timeout, < 9 minutes in all (bench/gpu_acceptance.py says which).
# 3. Writes $OUT_DIR/gpu_acceptance.json after EVERY step (and the launches' output to
#    gpu_acceptance.log), so a run cut off still reports.
# Exit: 0 PASS, 1 a step failed or timed out, 2 no GPU (the JSON says "no GPU"), 3 install failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-bench/results}}
WHEELS=${WHEELS:-wheels}
PREFIX=${PDIST_PREFIX:-/tmp/pdist-prefix}
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p "$OUTDIR"
say() { echo "gpu_acceptance: $*"; }
fail_json() {  # status, message: the summary when Python cannot even start the run
  printf '{"script": "bench/gpu_acceptance.sh", "status": "%s", "error": "%s", "steps": []}\n' "$1" "$2" \
    >"$OUTDIR/gpu_acceptance.json.tmp" && mv -f "$OUTDIR/gpu_acceptance.json.tmp" "$OUTDIR/gpu_acceptance.json"
}
if ! command -v "$PY" >/dev/null 2>&1; then
  say "FAIL no Python at '$PY'"; fail_json "install failed" "no Python at $PY"; exit 3
fi
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  say "installing $(ls "$WHEELS"/*.whl | wc -l) wheel(s) from $WHEELS into $PREFIX (--prefix)"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed \
        --prefix "$PREFIX" "$WHEELS"/*.whl; then
    say "FAIL pip install from $WHEELS"; fail_json "install failed" "pip install from $WHEELS failed"; exit 3
  fi
  # where pip put the packages: site-packages, or dist-packages (Debian's schemes) under the prefix
  SITE=$(find "$PREFIX" -maxdepth 5 -type d \( -name site-packages -o -name dist-packages \) | paste -sd: -)
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$PREFIX/bin:$PATH" LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  for lib in "$PREFIX"/lib/libmpi.so.12 "$PREFIX"/lib/libmpi.so; do
    if [ -e "$lib" ]; then export MPI4PY_LIBMPI="$lib"; break; fi     # mpi4py's wheel loads it at run time
  done
else
  say "no wheels in '$WHEELS': using this tree and the MPI already installed"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"     # this tree's pdist and its bench/ and tests/
"$PY" -c "import pdist, sys; print('gpu_acceptance: pdist from', pdist.__file__, '| python', sys.version.split()[0])" ||
  { say "FAIL pdist does not import"; fail_json "install failed" "pdist does not import"; exit 3; }
if ! "$PY" -c "import os; from mpi4py import MPI; print('gpu_acceptance: MPI', MPI.Get_library_version().splitlines()[0], 'from', os.environ.get('MPI4PY_LIBMPI', 'the default search'))"; then
  say "WARNING: mpi4py has no MPI library (carry the mpich wheel in $WHEELS): the multi-rank steps will fail"
fi
exec "$PY" bench/gpu_acceptance.py --out "$OUTDIR" "${@:2}"
