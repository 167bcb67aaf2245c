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
    zbv = sim.simulate(S.make_schedule("zb-v", 2, 4))            # F, I (B) and W in their own colours
    path = plot_timeline([planned, planned, zbv], ["a", "b", "zb-v"], str(tmp_path / "pp.png"))
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


# ------------------------------------------------------------------ zero bubble (issue 27)
ZB = ("zb-h1", "zb-v", "dualpipev")
ZB_CASES = [(name, p, m) for name in ZB for p in range(1, 5) for m in sorted({1, p, 2 * p, 4 * p})]


@pytest.mark.parametrize("name,p,m", ZB_CASES)
def test_zero_bubble_schedules_are_valid_and_cannot_deadlock(name, p, m):
    """check_schedule (one F and one BACKWARD, or one B then one W, per (mb, chunk); matched
    messages; no deadlock) and the blocking-send proof, for p 1..4 and m in {1, p, 2p, 4p}."""
    sched = S.make_schedule(name, p, m)
    assert sched.placement == S.placement_of(name) == ("loop" if name == "zb-h1" else "v")
    peaks = sim.check_schedule(sched, m)
    sim.simulate_rendezvous(sched)                    # the executor's plan under blocking sends
    v = 1 if name == "zb-h1" else 2
    split = [i for prog in sched for i in prog if i.op in (S.BACKWARD_INPUT, S.BACKWARD_WEIGHT)]
    assert len([i for i in split if i.op == S.BACKWARD_WEIGHT]) >= (m * v * p if name != "dualpipev" else 1)
    if name == "zb-h1":                               # 1F1B's peak memory: min(m, p) on every stage
        assert peaks == [min(m, p)] * p
    elif name == "zb-v":                              # 2p chunk-activations = p whole stages, as 1F1B
        assert peaks == [2 * min(m, p)] * p
    elif m >= 2 * p:
        assert peaks == [2 * p + 1] * p               # DualPipeV: half a stage more


@pytest.mark.parametrize("name,p,m", [c for c in ZB_CASES if c[2] >= (2 * c[1] if c[0] == "dualpipev" else c[1])])
def test_zero_bubble_planned_bubble_is_the_formula(name, p, m):
    """t_F = t_B = t_W = 1: ZB-H1 idles (p-1)(t_F+t_B-t_W) per stage, ZB-V and DualPipeV (p-1) t_F."""
    spans = sim.simulate(S.make_schedule(name, p, m), t_f=1.0, t_b=2.0, t_w=1.0)
    work = 3 * m * (1 if name == "zb-h1" else 2)
    end = max(e for r in spans for _, _, e in r)
    assert end - work == (p - 1) * ((1 + 1 - 1) if name == "zb-h1" else 1)
    want = sim.theoretical_bubble(p, m, schedule=name)
    assert want == (p - 1) / (work + p - 1)
    assert sim.bubble_fraction(spans) == pytest.approx([want] * p, abs=1e-12)


def test_zb_h1_idles_a_third_of_1f1b():
    for p, m in ((2, 4), (4, 4), (4, 8)):
        one = sim.simulate(S.one_f_one_b(p, m), t_f=1.0, t_b=2.0)
        zb = sim.simulate(S.make_schedule("zb-h1", p, m), t_f=1.0, t_b=2.0, t_w=1.0)
        idle = [max(e for r in t for _, _, e in r) - 3 * m for t in (one, zb)]
        assert idle == [3 * (p - 1), p - 1]           # the same work, 3 t_F per micro-batch


def test_placements_and_make_schedule_arguments():
    for p in (1, 2, 3, 4):
        for where, v in (("loop", 3), ("v", 2)):
            ks = sorted(S.virtual_stage(c, p, s, where) for s in range(p) for c in range(v))
            assert ks == list(range(p * v))
            assert all(S.stage_owner(S.virtual_stage(c, p, s, where), p, where) == (s, c)
                       for s in range(p) for c in range(v))
    assert [S.virtual_stage(c, 4, 0, "v") for c in (0, 1)] == [0, 7]     # rank 0: first and last stage
    assert S.make_schedule("zb-v", 2, 4).placement == "v" and S.make_schedule("1f1b", 2, 2).placement == "loop"
    assert S.make_schedule("zb-v", 2, 4, v=2) == S.make_schedule("zb-v", 2, 4)
    with pytest.raises(ValueError, match="two chunks per rank.*v=2"):
        S.make_schedule("dualpipev", 2, 4, v=1)
    with pytest.raises(ValueError, match="one chunk per rank"):
        S.make_schedule("zb-h1", 2, 4, v=2)
    with pytest.raises(ValueError, match="positive integer"):
        S.make_schedule("zb-v", 2, 0)
    with pytest.raises(ValueError, match="'v' placement has chunks 0 and 1"):
        S.virtual_stage(2, 4, 0, "v")


def _ops(name, p, m):
    return [list(r) for r in S.make_schedule(name, p, m)]


def test_checker_rejects_broken_zero_bubble_schedules():
    bad = _ops("zb-h1", 3, 3)                         # W before its B
    i = next(k for k, x in enumerate(bad[2]) if x.op == S.BACKWARD_INPUT)
    j = next(k for k, x in enumerate(bad[2]) if x.op == S.BACKWARD_WEIGHT and x.mb == bad[2][i].mb)
    bad[2][i], bad[2][j] = bad[2][j], bad[2][i]
    with pytest.raises(AssertionError, match="W.*runs before its B"):
        sim.check_schedule(bad, 3)
    bad = _ops("zb-h1", 3, 3)                         # a B's gradient sent after the W: a B waits on a W
    i = next(k for k, x in enumerate(bad[1]) if x.op == S.SEND_GRAD)
    send = bad[1].pop(i)
    w = next(k for k, x in enumerate(bad[1]) if x.op == S.BACKWARD_WEIGHT and x.mb == send.mb)
    bad[1].insert(w + 1, send)
    with pytest.raises(AssertionError, match="between a B and its SEND_GRAD"):
        sim.check_schedule(bad, 3)
    bad = _ops("zb-v", 2, 2)                          # a W missing
    bad[0].remove(next(x for x in bad[0] if x.op == S.BACKWARD_WEIGHT))
    with pytest.raises(AssertionError, match="have no W"):
        sim.check_schedule(S.Schedule(bad, "v"), 2)
    bad = _ops("zb-v", 2, 2)                          # the V's messages checked on the V's stages
    with pytest.raises(AssertionError, match="does not match"):
        sim.check_schedule(bad, 2)                    # read as "loop": the peers do not match


def test_ascii_draws_f_b_w_distinctly():
    zb = sim.simulate(S.make_schedule("zb-h1", 4, 8))
    text = ascii_timeline(zb)
    for mb in range(8):
        assert f"F{mb}-" in text and f"I{mb}~" in text and f"W{mb}+" in text
    assert "B0=" not in text and "input grads (the paper's B) ('~')" in text and "W<mb> weight grads ('+')" in text
    assert f"idle {sim.theoretical_bubble(4, 8, schedule='zb-h1'):5.1%}" in text
    dual = ascii_timeline(sim.simulate(S.make_schedule("dualpipev", 2, 4)))
    assert "B3a" in dual and "I3a" in dual or "W3a" in dual      # whole and split backwards in one
    assert label(S.Instr(S.BACKWARD_WEIGHT, 2, 1), v=2) == "W2b"


def test_the_planner_knows_the_zero_bubble_schedules():
    """pdist.plan's stash and bubble formulas equal what the schedules do (simulated)."""
    from pdist.plan.model import Layout, bubble_ratio, stash, virtual_stages
    for name in ZB:
        for p in (2, 3, 4):
            for m in range(1, 4 * p + 1):
                sched = S.make_schedule(name, p, m)
                peaks, v = sim.check_schedule(sched, m), 1 if name == "zb-h1" else 2
                spans = sim.simulate(sched, t_w=1.0)
                idle = max(e for r in spans for _, _, e in r) / (3 * m * v) - 1   # idle / compute
                if m < {"zb-h1": 1, "zb-v": p, "dualpipev": 2 * p}[name]:
                    with pytest.raises(ValueError, match="needs m >="):
                        Layout(pp=p, m=m, schedule=name).check()
                    assert all(stash(Layout(pp=p, m=m, schedule=name), r) >= peaks[r] / v for r in range(p))
                    continue
                lay = Layout(pp=p, m=m, schedule=name)
                lay.check()
                assert lay.v == v and bubble_ratio(lay) == pytest.approx(idle, abs=1e-12), (name, p, m)
                assert [stash(lay, r) for r in range(p)] == [k / v for k in peaks], (name, p, m)
                assert sorted(virtual_stages(lay, r) for r in range(p)) == sorted(
                    [S.virtual_stage(c, p, r, sched.placement) for c in range(v)] for r in range(p))
