"""The GPU acceptance run (called by bench/gpu_acceptance.sh): steps (a)-(e) of issue 24, each
in its own launch under its own timeout, all inside one budget, and one JSON summary
rewritten (atomically) after every step, so a run cut off still reports.

    python bench/gpu_acceptance.py --out DIR [--budget 530] [--only a,e] [--timeout a=60]

    a   one process: CuPy equals NumPy in float64 (forward, backward, AdamW)   bench/gpu_worker.py
    e   GPT-2-small step MFU per precision (fp32, tf32, bf16) against the measured matmul
        ceiling and the spec peak                                              bench/gpu_mfu.py
    b   collectives at 1, 2 and 4 ranks on the one GPU, over NCCL (where the NCCL version
        lets several ranks share a GPU) and over MPI host staging            gpu_worker.py --steps b
    c   DDP with >= 8 buckets, ZeRO-3, 1F1B at 2 and 4 ranks == one process  gpu_worker.py --steps c
    d   bf16 and fp16 mixed precision (DDP, 2 ranks) == one process          gpu_worker.py --steps d

Several ranks on one GPU: ``NCCL_MULTI_RANK_GPU_ENABLE=1`` is set for the NCCL launches (NCCL
2.30+ needs it; older NCCL refuses, and that launch is a SKIP with the reason). The facts
(CuPy, NCCL, CUDA driver and runtime versions, the device, its compute mode, the transport
the automatic choice takes) come from a probe subprocess, so this process never holds a
CUDA context. Exit 0 all PASS (SKIPs listed), 1 any FAIL or TIMEOUT, 2 no GPU.
``--standin`` (tests only): the sizes of the CI test, on the strict CuPy stand-in."""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
SUMMARY = "gpu_acceptance.json"

PROBE = r"""
import json, os
f = {"gpu": False}
def get(key, fn):
    try:
        f[key] = fn()
    except Exception as e:
        f[key] = None
        f.setdefault("missing", []).append(f"{key}: {type(e).__name__}: {e}")
try:
    import cupy
    f["cupy"] = cupy.__version__
    rt = cupy.cuda.runtime
    f["devices"] = n = int(rt.getDeviceCount())
    f["gpu"] = n > 0
except Exception as e:
    f["error"] = f"{type(e).__name__}: {e}"
if f["gpu"]:
    p = rt.getDeviceProperties(0)
    name = p.get("name", b"?")
    f["device"] = name.decode() if isinstance(name, bytes) else str(name)
    modes = {0: "DEFAULT", 1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}
    get("compute_mode", lambda: modes.get(int(p["computeMode"]), str(p["computeMode"])))
    get("memory_bytes", lambda: int(p["totalGlobalMem"]))
    get("sm_count", lambda: int(p["multiProcessorCount"]))
    get("capability", lambda: f"{p['major']}.{p['minor']}")
    get("pci_bus_id", lambda: cupy.cuda.Device(0).pci_bus_id)
    get("driver", lambda: int(rt.driverGetVersion()))
    get("runtime", lambda: int(rt.runtimeGetVersion()))
try:
    from pdist.comm import gpu_transport
    code = gpu_transport.version()
    f["nccl"] = gpu_transport.version_str(code)
    os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    f["transport_shared_gpu"] = gpu_transport.choose_transport(True, code)
except Exception as e:
    f.setdefault("error", f"{type(e).__name__}: {e}")
print("PROBE " + json.dumps(f))
"""


def probe(env):
    """The machine's facts, from a subprocess (no CUDA context here)."""
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    for line in p.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    return {"gpu": False, "error": (p.stdout + p.stderr)[-2000:]}


def plan(facts, standin):
    """[(step, label, ranks, transport, argv, timeout_s)] in the order they run."""
    w, mfu = os.path.join(HERE, "gpu_worker.py"), os.path.join(HERE, "gpu_mfu.py")
    sizes = ["--sizes", "0,1,7,1001" if standin else "0,1,7,1001,1048576"]
    mfu_args = (["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--vocab", "64", "--block-size", "16",
                 "--batch-size", "2", "--steps", "1", "--matmul-n", "64", "--target", "0"] if standin else [])
    rows = [("a", "CuPy == NumPy float64: forward, backward, AdamW", 1, None, [w, "--steps", "a"], 120),
            ("e", "GPT-2-small MFU by precision", 1, None, [mfu, "--precision", "fp32,tf32,bf16", *mfu_args], 240)]
    for n in (1, 2, 4):
        for t in ("nccl", "mpi-host"):
            rows.append(("b", f"collectives n={n} {t}", n, t, [w, "--steps", "b", *sizes], 90))
    for n in (2, 4):
        for t in ("nccl", "mpi-host"):
            rows.append(("c", f"DDP (>= 8 buckets), ZeRO-3, 1F1B, big-activation pipelines n={n} {t}", n, t,
                         [w, "--steps", "c", *(["--pipe-rows", "16"] if standin else [])], 150))
    for t in ("nccl", "mpi-host"):
        rows.append(("d", f"bf16 and fp16 mixed precision n=2 {t}", 2, t, [w, "--steps", "d"], 150))
    return rows


def skip_reason(facts, ranks, transport):
    """Why a launch cannot run on this machine (None: it can)."""
    shared = ranks > max(1, facts.get("devices", 1))
    if shared and facts.get("compute_mode") in ("EXCLUSIVE_PROCESS", "EXCLUSIVE_THREAD", "PROHIBITED"):
        return f"compute mode {facts['compute_mode']}: several processes cannot share the GPU"
    if transport == "nccl" and shared:
        chosen, why = facts.get("transport_shared_gpu") or ("mpi-host", "no NCCL")
        if chosen != "nccl":
            return why
    return None


def parse(out):
    """The CASE rows (gpu_worker.py) and the MFU result (gpu_mfu.py) in a launch's output."""
    got = {}
    for line in out.splitlines():
        for tag in ("WORKER ", "MFU "):
            if line.startswith(tag):
                try:
                    got.update(json.loads(line[len(tag):]))
                except ValueError:
                    pass
    return got


def write(path, summary):
    """Rewrite the summary atomically (a reader never sees half a file)."""
    summary["updated_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    os.replace(tmp, path)


def run_step(row, facts, env, left, log):
    """One launch under min(its timeout, the budget left): its summary entry."""
    from pdist.testing import launch
    step, label, ranks, transport, argv, timeout = row
    entry = {"step": step, "label": label, "ranks": ranks, "transport": transport}
    why = skip_reason(facts, ranks, transport)
    if why or left < 5:            # (under 5 s left: not worth a start)
        entry.update(status="SKIP" if why else "NOT RUN", reason=why or "out of the run's time budget")
        return entry
    e = dict(env)
    if transport:
        e["PDIST_GPU_TRANSPORT"] = transport
    if transport == "nccl" and ranks > max(1, facts.get("devices", 1)):
        e["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"      # NCCL 2.30+: several ranks on one GPU
    t = round(max(0.1, min(timeout, left)), 1)
    run = launch(ranks, argv[0], *argv[1:], timeout=t, env=e, wrap=False, max_output=200_000)
    got = parse(run.out)
    status = "TIMEOUT" if run.timed_out else ("PASS" if run.rc == 0 else "FAIL")
    entry.update(status=status, rc=run.rc, seconds=round(run.seconds, 2), timeout_s=t, **got)
    if status != "PASS":
        entry["tail"] = run.out[-3000:]
    log.write(f"== {step}: {label} ({status}, {run.seconds:.1f} s)\n{run.out}\n")
    log.flush()
    return entry


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "results"))
    p.add_argument("--budget", type=float, default=530.0, help="seconds for all the steps (< 9 minutes)")
    p.add_argument("--only", default="", help="comma-separated step letters (default: all)")
    p.add_argument("--timeout", action="append", default=[], help="LETTER=SECONDS, overrides a step's timeout")
    p.add_argument("--standin", action="store_true", help="tests: small sizes, on the strict CuPy stand-in")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    path, t0 = os.path.join(a.out, SUMMARY), time.monotonic()
    env = dict(os.environ, PDIST_DEVICE="gpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(q for q in (ROOT, env.get("PYTHONPATH", "")) if q)
    summary = {"script": "bench/gpu_acceptance.sh", "status": "running", "standin": a.standin,
               "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "budget_s": a.budget,
               "facts": probe(env), "steps": []}
    facts = summary["facts"]
    print("gpu_acceptance: found " + json.dumps(facts), flush=True)
    if not facts.get("gpu"):
        summary["status"] = "no GPU"
        write(path, summary)
        print(f"gpu_acceptance: FAIL no GPU: CuPy with a CUDA device is needed; nothing checked ({path})")
        return 2
    over = dict(kv.split("=", 1) for kv in a.timeout)
    only = set(filter(None, a.only.split(",")))
    rows = [r[:5] + (float(over.get(r[0], r[5])),) for r in plan(facts, a.standin) if not only or r[0] in only]
    write(path, summary)
    with open(os.path.join(a.out, "gpu_acceptance.log"), "w") as log:
        for row in rows:
            entry = run_step(row, facts, env, a.budget - (time.monotonic() - t0), log)
            summary["steps"].append(entry)
            summary["elapsed_s"] = round(time.monotonic() - t0, 1)
            write(path, summary)
            print(f"   {entry['status']:7s} {row[0]}: {row[1]}" + (f" ({entry.get('seconds')} s)"
                  if "seconds" in entry else f": {entry.get('reason')}"), flush=True)
    bad = [s for s in summary["steps"] if s["status"] in ("FAIL", "TIMEOUT", "NOT RUN")]
    summary["status"] = "FAIL" if bad else "PASS"
    write(path, summary)
    print(f"gpu_acceptance: {summary['status']} ({len(bad)} of {len(rows)} launches not passed); summary {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
