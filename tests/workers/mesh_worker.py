"""DeviceMesh at every factorization of the world size: coordinates follow
world = (pp*DP + dp)*TP + tp, each axis group holds exactly the ranks that
differ only along that axis (checked by an all_reduce of world ranks and by
.ranks), pipeline neighbours are right; invalid shapes raise on every rank."""
import itertools

import numpy as np

from pdist import comm
from pdist.testing import report


def factorizations(n):
    return [(dp, tp, pp) for dp, tp, pp in itertools.product(range(1, n + 1), repeat=3) if dp * tp * pp == n]


def check(world, dp, tp, pp):
    m = comm.DeviceMesh(dp=dp, tp=tp, pp=pp)
    r = world.rank
    assert (m.pp_rank * dp + m.dp_rank) * tp + m.tp_rank == r == m.rank_of(m.dp_rank, m.tp_rank, m.pp_rank)
    assert tuple(m.coords) == (m.pp_rank, m.dp_rank, m.tp_rank) and m.coords.tp == m.tp_rank
    expect = {
        "tp": [m.rank_of(m.dp_rank, t, m.pp_rank) for t in range(tp)],
        "dp": [m.rank_of(d, m.tp_rank, m.pp_rank) for d in range(dp)],
        "pp": [m.rank_of(m.dp_rank, m.tp_rank, p) for p in range(pp)],
    }
    for axis, g in (("tp", m.tp_group), ("dp", m.dp_group), ("pp", m.pp_group)):
        assert g.name == axis and g.ranks == expect[axis], (axis, g.ranks, expect[axis])
        assert g.size == getattr(m, f"{axis}_world_size") and g.rank == getattr(m, f"{axis}_rank")
        x = np.array([float(r)])
        g.all_reduce(x)                                          # real traffic inside the group
        assert x[0] == sum(expect[axis]), (axis, x, expect[axis])
    assert m.pp_is_first_stage == (m.pp_rank == 0) and m.pp_is_last_stage == (m.pp_rank == pp - 1)
    assert m.pp_prev_rank == (None if m.pp_rank == 0 else m.pp_rank - 1)
    assert m.pp_next_rank == (None if m.pp_rank == pp - 1 else m.pp_rank + 1)
    if m.pp_next_rank is not None:                               # pipeline send to the next stage
        m.pp_group.send(np.array([r]), m.pp_next_rank)
    if m.pp_prev_rank is not None:
        got = np.empty(1, np.int64)
        m.pp_group.recv(got, m.pp_prev_rank)
        assert got[0] == m.rank_of(m.dp_rank, m.tp_rank, m.pp_rank - 1)


def main():
    world = comm.init()
    n = world.size
    for shape in factorizations(n):
        check(world, *shape)
    bad = [dict(dp=n + 1), dict(dp=2, tp=n), dict(tp=0), dict(pp=-1, dp=-n), dict(dp=1.5)]
    for kw in bad:
        try:
            comm.DeviceMesh(**kw)
            ok = False
        except ValueError as e:
            msg = str(e)
            ok = "DeviceMesh" in msg and (("world has" in msg and f"{n} rank" in msg) or "positive integer" in msg)
            assert ok, msg
        assert all(world.all_gather_object(ok)), kw
    try:
        comm.DeviceMesh(dp=n + 1)
    except ValueError as e:
        assert f"dp*tp*pp = {n + 1}" in str(e) and f"mpirun -n {n + 1}" in str(e), str(e)
    world.barrier()
    if world.rank == 0:
        report(n=n, shapes=[list(f) for f in factorizations(n)])


if __name__ == "__main__":
    main()
