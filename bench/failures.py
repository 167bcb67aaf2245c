"""Time to detection of every failure scenario (docs/failures.md), under plain mpiexec.

    python bench/failures.py                  # 2 and 4 ranks, PDIST_TIMEOUT=5
    python bench/failures.py --n 4 --timeout 5 --cases exception,exit0

Each scenario of tests/workers/fail_cases.py runs as a user would run it
(``mpiexec -n N python script``). The faulting rank stamps the moment of its
fault (``time.time()``) just before it; detection = the moment the whole job
has ended (mpiexec returned) minus that stamp. "seconds" is the whole launch,
start-up included. The first error line shown is a rank that was waiting on
the faulty one (the one that tells what happened)."""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pdist.testing import failures, launch, reports  # noqa: E402

CASES = ["exception", "exit0", "early_exit", "extra", "sigint", "sigkill", "timeout", "async_skip",
         "async_unwaited", "object_mismatch", "subgroup", "skipped_step", "clean"]


def table(rows, heads):
    cells = [[f"{v:.2f}" if isinstance(v, float) else str(v) for v in r] for r in rows]
    w = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(heads)]
    fmt = lambda r: "  ".join(c.ljust(w[i]) if i in (0, len(w) - 1) else c.rjust(w[i])  # noqa: E731
                              for i, c in enumerate(r)).rstrip()
    return "\n".join([fmt(heads), fmt(["-" * x for x in w]), *map(fmt, cells)])


def headline(text):
    """The exception line of a rank's report."""
    for line in text.splitlines():
        if "Error:" in line or "exited" in line or "KeyboardInterrupt" in line:
            return line.split("Error: ", 1)[-1][:110]
    return ""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default="2,4")
    p.add_argument("--timeout", type=float, default=5.0, help="PDIST_TIMEOUT of the runs")
    p.add_argument("--cases", default=",".join(CASES))
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in a.n.split(",")]:
            for case in a.cases.split(","):
                if case == "subgroup" and n % 2:
                    continue
                env = {"PDIST_TIMEOUT": str(a.timeout), "PDIST_FLIGHT_DIR": tmp}
                res = launch(n, ROOT / "tests/workers/fail_cases.py", case, timeout=120, env=env, wrap=False)
                t_end = time.time()
                stamps = [r["fault_at"] for r in reports(res.out) if "fault_at" in r]
                detect = t_end - min(stamps) if stamps else float("nan")
                f = failures(res.out)
                witness = next((f[r] for r in (0, 2, 3, 1) if r in f), "")
                rows.append([case, n, "killed" if res.timed_out else res.rc, detect, res.seconds, headline(witness)])
    print(f"failure detection under plain mpiexec, PDIST_TIMEOUT={a.timeout:g}, {os.cpu_count()} cores, "
          f"load average {open('/proc/loadavg').read().split()[0]} (at the end), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print(table(rows, ["scenario", "ranks", "exit", "detect s", "launch s", "first error line (a waiting rank)"]))
    from machine import report
    report("failures", {"timeout": a.timeout, "rows": rows})


if __name__ == "__main__":
    main()
