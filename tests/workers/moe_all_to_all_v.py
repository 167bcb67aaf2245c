"""all_to_all_v on real MPI, many cases in one launch: uneven counts with zeros (a rank
sending nothing, a rank receiving nothing, everything to one rank), 1-D and (rows, 3)
blocks, float64/float32/int64/bfloat16, the MPI and hand-built pairwise algorithms, async,
the world and (at 4 ranks) the dp sub-groups of a 2x2 mesh; accounted bytes and the
pairwise algorithm's wire bytes checked exactly; bad counts raise on every rank."""
import numpy as np

from pdist import comm
from pdist.comm import CollectiveMismatchError
from pdist.testing import report


def counts_of(case, n):
    """counts[p][q] = rows rank p sends rank q (the whole table: every rank builds it)."""
    rng = np.random.default_rng([case, n])
    c = rng.integers(0, 4, (n, n))
    if case % 4 == 1:
        c[0, :] = 0                                   # rank 0 sends nothing
    elif case % 4 == 2:
        c[:, n - 1] = 0                               # the last rank receives nothing
    elif case % 4 == 3:
        c[:] = 0
        c[:, 0] = rng.integers(0, 5, n)               # everything to rank 0
    return c


def rows(p, q, k, tail, dtype):
    """The k rows rank p sends rank q: values that name (p, q, row)."""
    v = 1000 * p + 10 * q + np.arange(k * int(np.prod(tail)), dtype=np.int64).reshape((k,) + tail) % 7
    return v.astype(dtype)


def one_case(g, case, tail, dtype, alg, async_op):
    n, r = g.size, g.rank
    c = counts_of(case, n)
    inp = np.concatenate([rows(r, q, c[r, q], tail, dtype) for q in range(n)])
    want = np.concatenate([rows(p, r, c[p, r], tail, dtype) for p in range(n)])
    out = np.full_like(want, -1)
    g.reset_stats()
    w = g.all_to_all_v(out, inp, c[r], c[:, r], algorithm=alg, async_op=async_op)
    if w is not None:
        w.wait()
    assert out.shape == want.shape and np.array_equal(out.view(np.uint8), want.view(np.uint8)), \
        (g.name, case, tail, dtype, alg)
    row_bytes = int(np.prod(tail)) * np.dtype(dtype).itemsize
    sent = sum(int(c[r, q]) for q in range(n) if q != r) * row_bytes
    st = g.stats["all_to_all_v"]
    assert st["calls"] == 1 and st["bytes"] == sent, (g.name, case, st, sent)
    assert st["wire_bytes"] == (sent if alg == "pairwise" else 0), (g.name, case, alg, st)


def check_group(g):
    import ml_dtypes
    bf16 = np.dtype(ml_dtypes.bfloat16)
    done = 0
    for case in range(8):
        for tail, dtype in (((), np.float64), ((3,), np.float32), ((2, 2), np.int64), ((3,), bf16)):
            for alg, async_op in (("mpi", False), ("pairwise", False), ("mpi", True)):
                one_case(g, case, tail, dtype, alg, async_op)
                done += 1
    u = 5                                                    # equal counts: the formula
    inp = np.arange(u * g.size * 4, dtype=np.float64).reshape(u * g.size, 4)
    g.reset_stats()
    g.all_to_all_v(np.empty_like(inp), inp, [u] * g.size, [u] * g.size)
    assert g.stats["all_to_all_v"]["bytes"] == (g.size - 1) * inp.nbytes // g.size
    return done


def expect_error(g, fn, *words):
    try:
        fn()
    except CollectiveMismatchError as e:
        assert all(w in str(e) for w in words), (words, str(e))
        ok = 1
    else:
        ok = 0
    assert all(g.all_gather_object(ok)), f"not every rank raised ({words})"


def check_errors(g):
    n, r = g.size, g.rank
    x = np.zeros((n, 2))
    expect_error(g, lambda: g.all_to_all_v(np.zeros((n, 2)), x, [1] * n, [1] * (n - 1) + [r == 0 and 2 or 1]),
                 "all_to_all_v", "sum(recv_counts)")
    expect_error(g, lambda: g.all_to_all_v(np.zeros((n, 3)), x, [1] * n, [1] * n), "out rows")
    if n > 1:                                  # rank 0 expects 2 rows from rank 1, which sends it 1
        sc = [1] * n
        rc = [1] * n if r else [1, 2] + [1] * (n - 2)
        for alg in ("mpi", "pairwise"):
            expect_error(g, lambda: g.all_to_all_v(np.zeros((sum(rc), 2)), x, sc, rc, algorithm=alg),
                         "recv_counts[1]=2", "which sends send_counts[0]=1")
    y = np.arange(2.0 * n)                     # usable afterwards
    out = np.empty_like(y)
    g.all_to_all_v(out, y, [2] * n, [2] * n)
    assert np.array_equal(out.reshape(n, 2), np.tile([2.0 * r, 2.0 * r + 1], (n, 1)))


def main():
    world = comm.init()
    done = check_group(world)
    check_errors(world)
    if world.size == 4:
        mesh = comm.DeviceMesh(dp=2, tp=2)
        done += check_group(mesh.dp_group)
    report(rank=world.rank, n=world.size, cases=done, ok=True)


if __name__ == "__main__":
    main()
