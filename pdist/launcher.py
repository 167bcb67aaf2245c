"""What the launcher said: the world it started, and the variables it left behind.

A launcher (MPICH's Hydra, Open MPI's prterun, Intel MPI, Slurm's srun) starts N processes and
tells each one, in its environment, how many there are. The MPI library mpi4py loaded reads its
own launcher's protocol (PMI for MPICH and Intel, PMIx for Open MPI 5 and ``srun --mpi=pmix``).
When the two do not match (mpi4py built against Open MPI under MPICH's ``mpirun``, the ``mpich``
wheel's ``mpirun`` in front of a site's Open MPI, ``srun`` without ``--mpi=pmi2`` on a site whose
default is none), each process starts MPI alone, as a world of one, and trains by itself: N
jobs that each print PASS. ``check_world(size, rank)`` compares what MPI says with every claim:

=====================================  ==========================================
``PMI_SIZE`` / ``PMI_RANK``            Hydra (MPICH), Intel MPI, ``srun --mpi=pmi2``
``OMPI_COMM_WORLD_SIZE`` / ``_RANK``   Open MPI's ``mpirun`` (4 and 5)
``PMIX_RANK`` (``PMIX_NAMESPACE``)     any PMIx server: Open MPI 5, ``srun --mpi=pmix``
``SLURM_STEP_NUM_TASKS``/``_PROCID``   ``srun`` (``SLURM_NTASKS`` inside a step)
``MPI_LOCALNRANKS``                    Hydra: the ranks on this node
=====================================  ==========================================

and raises ``WorldSizeError`` (also ``pdist.comm.WorldSizeError``) on every process whose world disagrees, naming the variable, the
launcher, ``MPI.Get_library_version()`` and the fix. Slurm's variables count only inside a job
step (``SLURM_STEP_ID`` set), and only when no MPI launcher's own variable is there: ``mpirun``
inside an allocation inherits the allocation's ``SLURM_NTASKS``. ``PDIST_WORLD_CHECK=0`` turns the check off (a
process that means to run alone under a launcher).

``LAUNCHER_PREFIXES``: the prefixes of every launcher's variables; ``nested_env()`` removes them
so that a launch from inside a rank (lesson 08, the grader under a job) starts a new job instead
of joining (or being refused by) the one it runs in.
"""
import os

LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "MPI_LOCAL", "OMPI_", "PRTE_", "OPAL_",
                     "ORTE_", "I_MPI_", "SLURM_")
# user settings a launcher reads (not ones it sets for its ranks): kept in a nested launch
KEEP = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "OMPI_MCA_rmaps_base_oversubscribe",
        "PRTE_MCA_rmaps_default_mapping_policy", "OPAL_PREFIX", "I_MPI_ROOT")


class WorldSizeError(RuntimeError):
    """The MPI world is not the one the launcher started (each process would run alone)."""


SRUN_KEEP = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CONF")   # what a nested srun needs to find its job


def world_check_on(environ=None):
    """False only when ``PDIST_WORLD_CHECK=0`` (a process that means to run alone under a launcher)."""
    return (os.environ if environ is None else environ).get("PDIST_WORLD_CHECK", "").strip() != "0"


def in_a_job(environ=None):
    """True when this process is itself a rank of a launched job (a launcher's rank variable is set)."""
    return bool(claims(environ))


def nested_env(environ=None, launcher=None):
    """{name: None} for every launcher variable in ``environ`` (default ``os.environ``): the
    ``env=`` of ``pdist.testing.launch`` that removes them (a None value removes a variable).
    Kept: the user settings in ``KEEP``, and for a nested ``srun`` (``launcher`` its command) the
    job's id, so the new step runs in the same allocation."""
    environ = os.environ if environ is None else environ
    keep = KEEP + (SRUN_KEEP if launcher and os.path.basename(str(launcher)) == "srun" else ())
    return {k: None for k in environ if k.startswith(LAUNCHER_PREFIXES) and k not in keep}


def _int(environ, name):
    v = environ.get(name, "").strip()
    return int(v) if v.isdigit() else None


def claims(environ=None):
    """[(variable, launcher, claimed world size or None, claimed rank or None)] from the environment."""
    e = os.environ if environ is None else environ
    out = []
    if "PMI_SIZE" in e or "PMI_RANK" in e:
        out.append(("PMI_SIZE", "a PMI launcher (MPICH's Hydra, Intel MPI or srun --mpi=pmi2)",
                    _int(e, "PMI_SIZE"), _int(e, "PMI_RANK")))
    if "OMPI_COMM_WORLD_SIZE" in e:
        out.append(("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun", _int(e, "OMPI_COMM_WORLD_SIZE"),
                    _int(e, "OMPI_COMM_WORLD_RANK")))
    if "PMIX_RANK" in e:
        out.append(("PMIX_RANK", f"a PMIx server (namespace {e.get('PMIX_NAMESPACE', '?')})", None,
                    _int(e, "PMIX_RANK")))
    if not out and ("SLURM_STEP_ID" in e or "SLURM_STEPID" in e):
        var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in e else "SLURM_NTASKS"
        out.append((var, "Slurm's srun", _int(e, var), _int(e, "SLURM_PROCID")))
    return out


def _fix(var):
    if var.startswith("SLURM"):
        return ("start the job with the MPI plugin your MPI needs, `srun --mpi=pmix` (Open MPI) or "
                "`srun --mpi=pmi2` (MPICH, Intel MPI); `srun --mpi=list` shows them")
    return ("launch with the mpirun of the MPI that mpi4py uses (check `python -c \"from mpi4py import MPI; "
            "print(MPI.Get_library_version())\"`), or reinstall mpi4py for your launcher's MPI; a venv with "
            "the `mpich` wheel puts its own mpirun in .venv/bin, which only the mpich wheel's library answers "
            "(docs/cluster.md)")


def check_world(size, rank, local=None, environ=None):
    """Raise ``WorldSizeError`` when the world (``size``, ``rank``; ``local`` ranks on this node)
    is not what the launcher's variables say; returns the claims that were checked."""
    e = os.environ if environ is None else environ
    found = claims(e)
    for var, who, want, want_rank in found:
        if (want is not None and want != size) or (want_rank is not None and want_rank >= size):
            said = f"{var}={e.get(var)}" + (f" (rank {want_rank})" if want_rank is not None else "")
            raise WorldSizeError(_message(said, who, size, rank, var))
    want_local = _int(e, "MPI_LOCALNRANKS")
    if local is not None and want_local is not None and want_local != local:
        raise WorldSizeError(_message(f"MPI_LOCALNRANKS={want_local} (ranks on this node)", "MPICH's Hydra",
                                      size, rank, "MPI_LOCALNRANKS", f"; MPI sees {local} on this node"))
    return found


def _library():
    """The first words of ``MPI.Get_library_version()`` (only where mpi4py.MPI is loaded already:
    importing it starts MPI)."""
    import sys
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return "(mpi4py.MPI not loaded)"
    return " ".join(mpi.Get_library_version().splitlines()[0].split(",")[0].split())


def _message(said, who, size, rank, var, extra=""):
    lib = _library()
    return (f"this process was started by {who}, which says {said}, but MPI's world has {size} rank(s) "
            f"(this is rank {rank}){extra}: every process would train alone and report success. "
            f"mpi4py loaded {lib!r}, which did not join that launcher's job. Fix: {_fix(var)}.")


__all__ = ["WorldSizeError", "check_world", "claims", "nested_env", "in_a_job", "world_check_on",
           "LAUNCHER_PREFIXES"]
