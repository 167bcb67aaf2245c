"""What the default checks cost, and how fast they catch their faults (docs/failures.md).

    python bench/defaults.py                    # cost (1 process) and detection (2 ranks)
    python bench/defaults.py --steps 300 --skip-detection

Cost: the lessons' default GPT (2 layers, 4 heads, 64 wide, 32 tokens, batch 16, fp32, the
stdlib corpus) in one process, one step = forward_backward + AdamW step, median over
``--steps`` steps of each setting, the settings interleaved in blocks of 10 so that drift
of a loaded machine hits both alike: check_finite on vs off, and the batch hash (the step
stamp's blake2b of x and y) alone. Detection: the scenarios of tests/workers/defaults_*.py
under plain ``mpiexec -n 2``; the faulting rank stamps the moment of its fault, detection =
the end of the whole job (mpiexec returned) minus that stamp."""
import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pdist import data  # noqa: E402
from pdist.comm.flight_recorder import batch_hash  # noqa: E402
from pdist.course import lesson  # noqa: E402
from pdist.models.gpt import GPT  # noqa: E402
from pdist.parallel import Local  # noqa: E402
from pdist.testing import launch, reports  # noqa: E402

W = ROOT / "tests" / "workers"
SCENARIOS = [("per-rank loader, DP", "defaults_batch.py", ["dp", "rank"]),
             ("per-rank loader, TP", "defaults_batch.py", ["tp", "rank"]),
             ("per-rank loader, PP", "defaults_batch.py", ["pp", "rank"]),
             ("NaN weight on one rank, DDP default", "defaults_finite.py", ["ddp"]),
             ("fp16 NaN weight, 5 skips in a row", "defaults_finite.py", ["fp16"])]


def cost(steps):
    tokens, tok = data.char_dataset()
    cfg = lesson.gpt_config(tok.vocab_size)
    models = {on: Local(GPT(cfg, 0), check_finite=on) for on in (True, False)}
    opts = {on: lesson.make_adamw(m.parameters()) for on, m in models.items()}
    t = {True: [], False: []}
    for block in range(steps // 10):
        for on in (True, False):
            m, opt = models[on], opts[on]
            for i in range(10):
                x, y = m.local_batch(*data.get_batch(tokens, 16, cfg.block_size, 0, block * 10 + i))
                t0 = time.perf_counter()
                m.forward_backward(x, y)
                opt.step()
                opt.zero_grad()
                t[on].append(time.perf_counter() - t0)
    x, y = data.get_batch(tokens, 16, cfg.block_size, 0, 0)
    t0 = time.perf_counter()
    for _ in range(1000):
        batch_hash(x, y)
    h = (time.perf_counter() - t0) / 1000
    m = models[True]
    m.forward_backward(*m.local_batch(x, y))          # gradients in place, as after a step's sync
    t0 = time.perf_counter()
    for _ in range(1000):
        m._nonfinite(1.0)
    c = (time.perf_counter() - t0) / 1000
    on, off = statistics.median(t[True]), statistics.median(t[False])
    print(f"step (median of {len(t[True])}): check_finite on {on * 1e3:.3f} ms, off {off * 1e3:.3f} ms: "
          f"{(on - off) / off * 100:+.2f}%")
    print(f"the finite check alone ({len(m.parameters())} gradients, "
          f"{sum(p.data.size for p in m.parameters()):,} values): {c * 1e6:.1f} us = {c / off * 100:.2f}% of the step")
    print(f"batch hash of a 16 x 32 batch: {h * 1e6:.1f} us = {h / off * 100:.3f}% of the step")


def detection():
    for name, script, args in SCENARIOS:
        res = launch(2, W / script, *args, timeout=120, env={"PDIST_TIMEOUT": "20"}, wrap=False)
        t_end = time.time()
        stamps = [r["t_fault"] for r in reports(res.out) if r.get("t_fault")]
        caught = all(r.get("error") for r in reports(res.out)) and len(reports(res.out)) == 2
        d = t_end - min(stamps) if stamps else float("nan")
        print(f"{name:40s} detected after {d:.2f} s (job {res.seconds:.2f} s, every rank raised: {caught})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--skip-detection", action="store_true")
    a = ap.parse_args()
    cost(a.steps)
    if not a.skip_detection:
        detection()
