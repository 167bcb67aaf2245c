"""A graded run's verdict, from its signed reports (pdist/course/channel.py) alone.

``verdict(reports, forged, run, ranks, cap)`` returns ``{"status", "msg", "detail",
"checks"}``: status ``passed`` only when every rank reported every check passed, then
``done``, and the job exited 0 within its cap. Otherwise ``failing`` with ``msg`` (one
line: the first failing check: lowest check index, then a rank's own failure before one it
stopped (a peer failed, died or exited), then lowest rank) and ``detail`` (the
whole error: the watchdog's roll-call, the student's traceback, expected vs got). The
output (stdout) is only quoted for crashes; report lines printed there count for nothing.
``checks`` lists each check once: name, ok (on every rank that reported it), seconds (the
slowest rank), msg.
"""
from pdist.testing import REPORT_PREFIX

TAIL_LINES = 60


def verdict(reports, forged, run, ranks, cap, watchdog_s=5):
    reps = [r for r in reports if isinstance(r.get("rank"), int)]
    checks = _checks(reps)
    done = {r["rank"] for r in reps if r.get("done")}
    fails = [r for r in reps if r.get("ok") is False]
    unsigned = run.out.count(REPORT_PREFIX) + forged
    note = f" ({unsigned} forged/unsigned report lines ignored)" if unsigned else ""
    if not fails and done == set(range(ranks)) and run.rc == 0:
        return dict(status="passed", msg="", detail="", checks=checks)
    if fails:
        first = min(fails, key=lambda r: (r.get("index", 0), _consequence(r), r["rank"]))
        msg, detail = _failed_check(first, [r for r in fails if r.get("index") == first.get("index")],
                                    ranks, watchdog_s)
    elif run.timed_out:
        passed = done == set(range(ranks))
        msg = (f"stopped after {cap:.0f} s: " + ("every check passed, but the job did not end (a process "
               "your code started is still running?)" if passed else
               "no result (a rank is stuck outside pdist's collectives? an endless loop, input(), "
               "time.sleep or a blocking call the watchdog cannot see)"))
        detail = tail(run.out)
    else:
        msg, detail = _crash(run), tail(run.out)
    return dict(status="failing", msg=msg + note, detail=detail, checks=checks)


def _consequence(r):
    """A rank stopped because another failed, died or exited (the watchdog's reasons):
    that other rank's own report is the cause to show, whatever its rank number."""
    return r.get("kind") == "timeout" and r.get("reason") in ("failed", "dead", "exited")


def _failed_check(first, same, ranks, watchdog_s):
    name = first.get("check", "?")
    if all(r.get("kind") == "todo" for r in same):
        return f"{name}: {first.get('msg', '')}", ""
    timeouts = [r for r in same if r.get("kind") == "timeout" and r.get("reason") == "timeout"
                and isinstance(r.get("where"), str)]
    detail = str(first.get("detail") or first.get("msg", ""))
    if timeouts:
        return f"{name}: " + deadlock_line(timeouts, watchdog_s), detail
    where = f" (rank {first['rank']})" if ranks > 1 else ""
    return f"{name}: {first.get('msg', '')}{where}", detail


def _crash(run):
    lines = [ln for ln in run.out.strip().splitlines() if ln.strip() and REPORT_PREFIX not in ln]
    if run.rc == 0:
        return "ended without a result (exit 0: did your code call sys.exit or os._exit?)"
    err = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
    return f"crashed (exit {run.rc}): {err.strip()[:200]}"


def tail(out, n=TAIL_LINES):
    lines = out.rstrip().splitlines()
    return "\n".join((["..."] if len(lines) > n else []) + lines[-n:])


def _checks(reps):
    by = {}
    for r in reps:
        if "index" not in r or r.get("index", -1) < 0 and r.get("ok") is not False:
            continue
        c = by.setdefault(r["index"], {"check": r.get("check", "?"), "ok": True, "seconds": 0.0, "msg": ""})
        c["ok"] = c["ok"] and r.get("ok") is True
        c["seconds"] = max(c["seconds"], float(r.get("seconds") or 0.0))
        if r.get("ok") is False and not c["msg"]:
            c["msg"] = str(r.get("msg", ""))
    return [by[i] for i in sorted(by)]


def deadlock_line(timeouts, watchdog_s=5):
    """'deadlocked: ranks 0, 1, 2, 3 are all in send (0: send to rank 1; ...)' from each
    rank's watchdog headline ('send to rank 1 on group 'world'')."""
    waits = {r["rank"]: r["where"] for r in timeouts}
    ops = {w.split()[0] for w in waits.values()}
    ranks = sorted(waits)
    who = ("rank " + str(ranks[0])) if len(ranks) == 1 else \
        ("rank " + " and rank ".join(map(str, ranks)) if len(ranks) == 2 else "ranks " + ", ".join(map(str, ranks)))
    if len(ops) == 1 and len(ranks) > 1:
        head = f"deadlocked: {who} are {'both' if len(ranks) == 2 else 'all'} in {ops.pop()}"
    else:
        head = f"deadlocked: {who} wait{'s' if len(ranks) == 1 else ''}"
    where = "; ".join(f"{r}: {waits[r].split(' on group')[0]}" for r in ranks)
    return f"{head} ({where}; watchdog after PDIST_TIMEOUT={watchdog_s} s)"
