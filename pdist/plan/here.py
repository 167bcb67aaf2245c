"""``--cluster this`` as the job it runs in sees it: one node, or the nodes of a launch.

Under a launcher on several nodes, as on a real cluster, the launcher's variables give the
world and the ranks on this node: MPICH's Hydra ``PMI_SIZE`` and ``MPI_LOCALNRANKS``, Open
MPI's ``OMPI_COMM_WORLD_SIZE`` and ``OMPI_COMM_WORLD_LOCAL_SIZE``, Slurm's ``SLURM_NNODES``
and ``SLURM_NTASKS_PER_NODE``. Nodes = world / ranks per node; a "GPU" is a rank (a core),
as in ``this``. Inside the emulated cluster (pdist.cluster: ``PDIST_NODE_LINK`` set) the link
between nodes is the box's: ``PDIST_LINK_GBPS`` (the tbf limit, Gbit/s each way, which the
box sets when it limits) shared by the node's ranks, else the unlimited veth link as
measured below; its α is the measured one either way. On one node ``this`` is unchanged.

The box's link, measured: ``python -m pdist.cluster --nodes 2 --ranks-per-node 1 -- python
bench/box_link.py`` (MPICH wheel over TCP on the unlimited veth pair, one rank per node; 8 B
ping-pong for alpha, 24 MiB streamed in 1 MiB messages for beta), 5 runs on 2 cores of an Intel
Xeon shared with other jobs, load average 2.3-2.8, 2026-12-05: 4 runs at 7.18-7.42 GB/s and
4.6-5.5 us, one at 0.61 GB/s and 32.5 us (the two busy-polling ranks on one core). The median,
7.35 GB/s and 4.8 us, is below. Open MPI's wheel, once: 2.29 GB/s, 5.0 us. At ``--link-gbps 1``:
0.121 GB/s (3 runs; the limit is 0.125).
"""
import os
from dataclasses import replace

from pdist.plan.presets import CLUSTERS, Link

BOX_BETA = 7.35e9            # bytes/s one way, unlimited veth (the module doc)
BOX_ALPHA = 4.8e-6           # seconds per message over TCP between two nodes


def _int(e, *names):
    for n in names:
        v = e.get(n, "").strip().split("(")[0]
        if v.isdigit() and int(v) > 0:
            return int(v)
    return None


def job_nodes(environ=None):
    """(nodes, ranks per node) of the launch this process is a rank of, or None."""
    e = os.environ if environ is None else environ
    if _int(e, "SLURM_NNODES") and _int(e, "SLURM_NTASKS_PER_NODE") and "SLURM_STEP_ID" in e:
        return _int(e, "SLURM_NNODES"), _int(e, "SLURM_NTASKS_PER_NODE")
    size, local = _int(e, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"), _int(e, "OMPI_COMM_WORLD_LOCAL_SIZE",
                                                                   "MPI_LOCALNRANKS")
    if size and local and size % local == 0:
        return size // local, local
    return None


def this_cluster(environ=None):
    """The ``this`` preset, with the nodes of the launch and the box's link where there are."""
    e = os.environ if environ is None else environ
    base, job = CLUSTERS["this"], job_nodes(e)
    if job is None or job[0] < 2:
        return base
    nodes, per = job
    if e.get("PDIST_NODE_LINK"):
        try:
            gbps = float(e.get("PDIST_LINK_GBPS", "") or "nan")
        except ValueError:
            gbps = float("nan")
        beta = gbps * 1e9 / 8 if gbps > 0 else BOX_BETA
        inter = Link(beta / per, BOX_ALPHA)
        link = (f"the box's link {e['PDIST_NODE_LINK']}, " + (f"{gbps:g} Gbit/s" if gbps > 0 else "unlimited veth")
                + f" shared by {per} rank(s)")
    else:
        inter, link = base.inter, "the preset's link"
    name = f"this machine as {nodes} nodes x {per} ranks (one rank per core; between nodes {link})"
    return replace(base, name=name, gpus_per_node=per, nodes=nodes, inter=inter,
                   source=base.source + f"; nodes and ranks per node from the launcher; inter-node: {link}")
