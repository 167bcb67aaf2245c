#!/usr/bin/env bash
# GPU acceptance, one command, each step with its own timeout (typically a few minutes on one GPU).
#   (a) the lesson GPT on CuPy equals NumPy in float64 (rtol 1e-9)
#   (b) collectives, then DDP / ZeRO-3 / 1F1B at 2 and 4 ranks on the one GPU
#       (NCCL with several ranks per GPU where it allows it, else MPI host staging)
#   (c) GPT-2-small-shaped step time and MFU at float32/TF32 against the matmul
#       ceiling measured in the same run (target >= 35%)
# Exits 2 with "no GPU" where CuPy or a CUDA device is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}; MPIRUN=${MPIRUN:-.venv/bin/mpirun}
if ! $PY -c "import cupy, sys; sys.exit(0 if cupy.cuda.runtime.getDeviceCount() > 0 else 1)" >/dev/null 2>&1; then
  echo "gpu_acceptance: FAIL no GPU: CuPy with a CUDA device is needed (pip install 'pdist[gpu]'); nothing checked"
  exit 2
fi
fail=0
step() { local name=$1 t=$2; shift 2; echo "== $name (timeout ${t}s)"; if timeout "$t" "$@"; then echo "   PASS $name"; else echo "   FAIL $name (rc $?)"; fail=1; fi; }
step "a: lesson GPT CuPy == NumPy float64" 120 $PY -c "
import subprocess, json, sys, os
def run(dev):
    e = dict(os.environ, PDIST_DEVICE=dev)
    subprocess.run([sys.executable, 'lessons/00_autograd.py', '--dtype', 'float64', '--steps', '20', '--json', f'/tmp/acc_{dev}.json'], env=e, check=True, capture_output=True)
    return json.load(open(f'/tmp/acc_{dev}.json'))
c, g = run('cpu'), run('gpu')
import numpy as np
np.testing.assert_allclose(g['runs'][0]['loss'], c['runs'][0]['loss'], rtol=1e-9); print('   losses equal to rtol 1e-9')"
for n in 2 4; do
  step "b: gpu_check collectives n=$n" 120 env PDIST_DEVICE=gpu $MPIRUN -n $n $PY bench/gpu_check.py
  step "b: device collectives and pipelines n=$n" 150 env PDIST_DEVICE=gpu $MPIRUN -n $n $PY tests/strict_cupy/workers/device_comm.py "${PDIST_GPU_TRANSPORT:-auto}"
  # DDP, ZeRO-3, 1F1B: each equals single-process training (float64, rtol 1e-9) on the one GPU
  for layout in "--dp $n" "--dp $n --zero 3" "--pp $n --microbatches 4"; do
    step "b: layout $layout n=$n" 150 env PDIST_DEVICE=gpu $MPIRUN -n $n $PY tests/workers/layout_equiv.py $layout
  done
done
step "c: GPT-2-small step time and MFU (TF32)" 240 env CUPY_TF32=1 $PY bench/gpu_mfu.py
[ $fail = 0 ] && echo "gpu_acceptance: PASS" || echo "gpu_acceptance: FAIL"
exit $fail
