"""Where a benchmark ran: the facts every bench prints in its header and stores in its JSON.

    from machine import facts, header, record
    print(header("step_time"))               # one '# ...' line: CPU, cores, BLAS, numpy, load, date
    record("step_time", {"rows": rows})      # bench/results/step_time.json = {"machine": facts(), ...}

Facts: the CPU model (``/proc/cpuinfo``, else ``platform.processor()``), ``os.cpu_count()``
and the cores this process may use (its affinity mask), the BLAS library(ies) NumPy
loaded with their kernel (threadpoolctl's ``internal_api``, ``architecture``, ``version``,
``num_threads``), the numpy and Python versions, the 1/5/15-minute load average, the UTC
date, and the command line. A figure quoted without these cannot be compared with another.

The JSON goes to ``bench/results/<name>.json`` (ignored by git), or to the directory
named by ``PDIST_BENCH_OUT``. Under MPI only rank 0 should call ``record``.
"""
import json
import os
import platform
import sys
import time


def cpu_model():
    """The CPU's model name, e.g. 'Intel(R) Xeon(R) Processor' or 'AMD EPYC 7B13'."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas():
    """[{library, internal_api, version, architecture, threads}] of the BLAS NumPy uses."""
    import numpy  # noqa: F401  (loads the BLAS so threadpoolctl can see it)
    from threadpoolctl import threadpool_info
    return [{"library": i.get("filepath", "").rsplit("/", 1)[-1], "internal_api": i.get("internal_api"),
             "version": i.get("version"), "architecture": i.get("architecture"),
             "threads": i.get("num_threads")}
            for i in threadpool_info() if i.get("user_api") == "blas"]


def facts():
    """The machine facts as a dict (JSON-ready)."""
    import numpy
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "cores_usable": usable, "blas": blas(),
            "numpy": numpy.__version__, "python": platform.python_version(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "malloc_tune": os.environ.get("PDIST_MALLOC_TUNE", "(default)"),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}


def header(name, f=None):
    """One line naming the bench and the facts, starting with '#'."""
    f = f or facts()
    kern = ", ".join(f"{b['internal_api']} {b['version']} {b['architecture']}"
                     for b in f["blas"]) or "none seen"
    load = " ".join(f"{x:.2f}" for x in f["loadavg"])
    return (f"# {name}: {f['cpu']}, {f['cpu_count']} cores ({f['cores_usable']} usable); BLAS {kern}; "
            f"numpy {f['numpy']}; load {load}; PDIST_MALLOC_TUNE={f['malloc_tune']}; {f['date_utc']} UTC")


def record(name, results):
    """Write {"bench": name, "machine": facts(), **results} to <out dir>/<name>.json; return the path."""
    out = os.environ.get("PDIST_BENCH_OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "results")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as fh:
        json.dump({"bench": name, "machine": facts(), **results}, fh, indent=1, default=str)
    return path


def report(name, results):
    """Print the header and record the JSON (rank 0 of a bench, at its end)."""
    print(header(name))
    print(f"# recorded {record(name, results)}")
