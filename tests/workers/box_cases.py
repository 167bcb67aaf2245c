"""Scenarios inside the emulated cluster (tests/test_cluster_box.py): ``python box_cases.py NAME``.

* ``link``: 2 ranks (one per node): a ping-pong of 8 B messages (alpha) and MB messages streamed
  from rank 0 to rank 1 (beta); rank 0 reports the seconds and bytes (bench/box_link.py prints them).
* ``nodes``: 4 ranks on 2 nodes: what pdist sees (hostnames, node ids, the mesh's placement, the
  straggler detector's nodes, the planner's ``this`` cluster); every rank reports.
"""
import os
import sys
import time

import numpy as np


def link(mb=24, chunk=1 << 20):
    from mpi4py import MPI
    from pdist.testing import report
    c = MPI.COMM_WORLD
    small, big = np.zeros(1, np.uint8), np.zeros(chunk, np.uint8)
    for buf, n in ((small, 20), (big, 2)):             # warm-up: the connections are made
        for _ in range(n):
            (c.Send, c.Recv)[c.rank](buf, 1 - c.rank)
            (c.Recv, c.Send)[c.rank](buf, 1 - c.rank)
    c.Barrier()
    t0, rounds = time.perf_counter(), 200
    for _ in range(rounds):
        (c.Send, c.Recv)[c.rank](small, 1 - c.rank)
        (c.Recv, c.Send)[c.rank](small, 1 - c.rank)
    alpha = (time.perf_counter() - t0) / (2 * rounds)
    c.Barrier()
    t0 = time.perf_counter()
    for _ in range(mb * (1 << 20) // chunk):
        (c.Send, c.Recv)[c.rank](big, 1 - c.rank)
    c.Recv(small, 1) if c.rank == 0 else c.Send(small, 0)        # the last byte has arrived
    secs = time.perf_counter() - t0
    if c.rank == 0:
        report(alpha_s=alpha, stream_s=secs, stream_bytes=mb * (1 << 20), rate_Bps=mb * (1 << 20) / secs,
               host=MPI.Get_processor_name(), link=os.environ.get("PDIST_NODE_LINK"))


def nodes():
    from pdist import comm
    from pdist.comm import nodes as nd
    from pdist.faults import debug
    from pdist.models.gpt import GPT, GPTConfig
    from pdist.parallel import DataParallel
    from pdist.plan.here import this_cluster
    from pdist.testing import report
    from pdist.training import train
    from pdist.optim import AdamW
    w = comm.init()
    mesh = comm.DeviceMesh(dp=2, tp=2)
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    model = DataParallel(GPT(cfg, seed=0), w)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 32, (8, 8))
    train(model, AdamW(model.parameters(), lr=1e-3), lambda s: (x, x), 4)
    rep = debug.straggler_report(model, last=4, skip=0)
    cl = this_cluster()
    import warnings
    swapped = w.split(0, [0, 2, 1, 3][w.rank], name="swapped")        # tp across the nodes: warned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm.DeviceMesh(dp=2, tp=2)
        comm.DeviceMesh(dp=2, tp=2, world=swapped)
    warned = [str(x.message) for x in caught if "crosses nodes" in str(x.message)]
    report(rank=w.rank, hosts=nd.hosts(), node=nd.node_of(w.rank), count=nd.count(), placement=mesh.placement(),
           rep_nodes=getattr(rep, "nodes", None), rep_rows=[r.get("node") for r in rep.rows], rep_text=rep.text,
           plan=[cl.name, cl.gpus_per_node, cl.nodes, cl.inter.beta], link=os.environ.get("PDIST_NODE_LINK"),
           warned=warned,
           counter=open(f"/sys/class/net/{os.environ['PDIST_NODE_LINK']}/statistics/tx_bytes").read().strip())


if __name__ == "__main__":
    {"link": link, "nodes": nodes}[sys.argv[1]]()
