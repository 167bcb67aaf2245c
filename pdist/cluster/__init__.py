"""An emulated cluster on one machine: N nodes (network namespaces with their own hostnames,
IPC and /dev/shm) joined by real TCP links (veth pairs, a bridge for N > 2), optionally rate
limited (tbf), and MPI runs across them (MPICH or Open MPI). ``python -m pdist.cluster``;
docs/cluster.md, "Two nodes in one box".

    box.py       Box, available(), Result: the Python API
    netns.py     the namespaces, links, limits, counters and teardown (iproute2)
    files.py     the agent (the box's ssh), the hosts file, the hostfile
    launchers.py which mpiexec and Python, the launcher's command line
    state.py     the state record; removing what a dead run left (proved to be its own)
    guardian.py  the process that tears the box down when the harness ends
    cli.py       the command line
"""
from pdist.cluster.box import Box, BoxUnavailable, Result, available
from pdist.cluster.netns import BoxError

__all__ = ["Box", "BoxError", "BoxUnavailable", "Result", "available"]
