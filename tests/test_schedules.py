"""Pipeline schedules checked without communication (pdist.parallel.pipeline.schedules, simulate),
the stage partitioning, and the drawings."""
import pytest

from pdist.parallel.pipeline import schedules as S
from pdist.parallel.pipeline import simulate as sim
from pdist.parallel.pipeline.draw import ascii_timeline, label, plot_timeline
from pdist.parallel.pipeline.stages import partition_layers

CASES = [(name, p, m, v) for p in range(1, 7) for m in range(1, 3 * p + 1)
         for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3))
         if not (name == "interleaved" and m > p and m % p)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_schedule_is_valid(name, p, m, v):
    sched = S.make_schedule(name, p, m, v)
    assert len(sched) == p
    peaks = sim.check_schedule(sched, m)          # matching sends/recvs, happens-before, no deadlock
    if name == "gpipe":
        assert peaks == [m] * p
    elif name == "1f1b":
        assert peaks == [min(m, p - s) for s in range(p)] and max(peaks) <= p
    else:
        assert max(peaks) <= m * v


@pytest.mark.parametrize("name,p,m,v", [c for c in CASES if c[0] != "interleaved" or c[2] % c[1] == 0])
def test_planned_bubble_is_the_papers_formula(name, p, m, v):
    spans = sim.simulate(S.make_schedule(name, p, m, v), t_f=1.0, t_b=2.0)
    assert all(len(r) == 2 * m * v for r in spans)
    expected = (p - 1) / (v * m + p - 1)
    assert sim.bubble_fraction(spans) == pytest.approx([expected] * p, abs=1e-12)
    assert sim.theoretical_bubble(p, m, v) == pytest.approx(expected)


def test_interleaving_shrinks_the_bubble_and_grows_the_stash():
    p, m = 4, 8
    plain = sim.bubble_fraction(sim.simulate(S.one_f_one_b(p, m)))[0]
    inter = sim.bubble_fraction(sim.simulate(S.interleaved_1f1b(p, m, 2)))[0]
    assert inter < plain
    assert max(sim.check_schedule(S.interleaved_1f1b(p, m, 2), m)) > max(sim.check_schedule(S.one_f_one_b(p, m), m))


def _replace(sched, s, fn):
    out = [list(r) for r in sched]
    out[s] = fn(out[s])
    return out


def test_checker_rejects_broken_schedules():
    good = S.one_f_one_b(3, 4)
    # a backward before its forward
    def swap_first_backward(prog):
        i = next(k for k, x in enumerate(prog) if x.op == S.BACKWARD)
        j = next(k for k, x in enumerate(prog) if x.op == S.FORWARD and x.mb == prog[i].mb)
        prog[i], prog[j] = prog[j], prog[i]
        return prog
    with pytest.raises(AssertionError, match="before its forward|before its FORWARD|after the"):
        sim.check_schedule(_replace(good, 2, swap_first_backward), 4)
    # a send without its receive
    with pytest.raises(AssertionError, match="no matching"):
        sim.check_schedule(_replace(good, 1, lambda pr: [x for x in pr if not (x.op == S.RECV_ACT and x.mb == 3)]), 4)
    # the step before a backward
    with pytest.raises(AssertionError, match="OPTIMIZER_STEP"):
        sim.check_schedule(_replace(good, 0, lambda pr: [pr[-1]] + pr[:-1]), 4)
    # a deadlock: stage 0 waits for the gradient of micro-batch 0 before it sends micro-batch 1,
    # while the last stage runs both forwards before its first backward
    F, B = S.FORWARD, S.BACKWARD
    bad = [S._program(2, 0, 1, [(F, 0, 0), (B, 0, 0), (F, 1, 0), (B, 1, 0)]), S.gpipe(2, 2)[1]]
    with pytest.raises(S.DeadlockError, match="rank 0 at .*rank 1 at"):
        sim.check_schedule(bad, 2)


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        S.interleaved_1f1b(4, 5, 2)
    with pytest.raises(ValueError, match="positive integer"):
        S.gpipe(0, 4)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        S.make_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="interleaved"):
        S.make_schedule("1f1b", 2, 2, v=2)


def test_partition_layers():
    assert partition_layers(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert partition_layers(5, 2) == [(0, 3), (3, 5)]
    assert partition_layers(5, 2, [1, 4]) == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="4 .*stages but only 3 layers"):
        partition_layers(3, 4)
    with pytest.raises(ValueError, match="partition"):
        partition_layers(5, 2, [2, 2])


def test_ascii_timeline_draws_every_compute():
    p, m = 4, 8
    text = ascii_timeline(sim.simulate(S.one_f_one_b(p, m)))
    rows = text.splitlines()[:p]
    for row in rows:
        for mb in range(m):
            assert f"F{mb}-" in row and f"B{mb}=" in row
        assert f"idle {sim.theoretical_bubble(p, m):5.1%}" in row
    # stage s starts s forward-widths late, and every row spans the same makespan
    assert [r.index("F0") for r in rows] == [len("stage 0 |") + 3 * s for s in range(p)]
    assert len({len(r) for r in rows}) == 1
    inter = ascii_timeline(sim.simulate(S.interleaved_1f1b(2, 2, 2)))
    assert "F1b" in inter and label(S.Instr(S.BACKWARD, 3, 1), v=2) == "B3b"


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    planned = sim.simulate(S.gpipe(3, 4))
    path = plot_timeline([planned, planned], ["a", "b"], str(tmp_path / "pp.png"))
    assert (tmp_path / "pp.png").stat().st_size > 1000 and path.endswith(".png")


def test_measured_timeline_labels_every_span_and_aligns_its_time_axis():
    """A measured timeline (seconds): each span starts with as much of its label as fits, so a
    reader can tell the micro-batches apart, and the axis's ticks sit on the columns they name."""
    p, m = 2, 4
    planned = sim.simulate(S.one_f_one_b(p, m))
    measured = [[(i, t0 * 1e-3, t1 * 1e-3) for i, t0, t1 in rank] for rank in planned]  # 1 t_f = 1 ms
    end = max(t1 for rank in measured for _, _, t1 in rank)
    text = ascii_timeline(measured, width=round(3 * end * 1e3), axis="ms")  # three columns per ms
    rows = text.splitlines()
    for row in rows[:p]:
        for mb in range(m):
            assert f"F{mb}" in row and f"B{mb}=" in row, row
    ruler, times = rows[p], rows[p + 1]
    left = len("stage 0 |")
    assert ruler.index("+") == left and times.index("0") == left          # 0 ms under column 0
    assert len(ruler) == left + round(3 * end * 1e3) + 1 == rows[0].rindex("|") + 1  # ends on the border
    for tick in (c for c, ch in enumerate(ruler) if ch == "+"):
        label = times[tick:].split()[0]
        assert float(label) == pytest.approx((tick - left) / 3), (tick, label)
    assert times.rstrip().endswith(" ms") and "one column = 0.33 ms" in text
