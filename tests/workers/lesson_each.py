"""Run a lesson several times in one launch, as ``mpiexec ... python LESSON FLAGS`` would run it
once per case: one start-up of mpiexec and one import of pdist per rank for all of them.

    mpiexec -n 4 python tests/workers/lesson_each.py lessons/06_mesh.py "--dp 2 --tp 2;--dp 4" --steps 2

Before each case rank 0 prints ``=== case FLAGS`` (the test splits the output there); the lesson
runs with ``sys.argv = [LESSON, *COMMON, *FLAGS]`` as ``__main__``. A case that exits non-zero
(a FAIL, a flag error) ends the job, naming the case on every rank."""
import runpy
import sys

from pdist import comm

script, each, common = sys.argv[1], sys.argv[2], sys.argv[3:]
for case in [c.strip() for c in each.split(";") if c.strip()]:
    if comm.init().rank == 0:
        print(f"=== case {case}", flush=True)
    sys.argv = [script, *common, *case.split()]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise AssertionError(f"case {case!r}: {script} exited with {e.code}") from e
