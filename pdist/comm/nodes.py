"""Which node each rank runs on, from the hostnames, as on a real cluster: each rank's
hostname, gathered once (``comm.init()`` calls ``gather``), and the ranks of one host form a
node. Node ids number the hosts in the order of their lowest world rank.

    from pdist.comm import nodes
    nodes.host(r), nodes.node_of(r)          # world rank r's hostname and node id
    nodes.count(), nodes.names()             # how many nodes; their hostnames by node id
    nodes.spans([0, 2])                      # the nodes a group of world ranks touches
    nodes.placement(mesh)                    # {"tp": "inside a node", "dp": "across 2 nodes", ...}

In the emulated cluster (pdist.cluster) each node has its own hostname, so a job there sees
its nodes as it would on real machines. Before ``gather`` (no MPI) this process is its own
node. The gather is one object all-gather on MPI's world communicator at start-up, outside
pdist's groups (no group's statistics or fingerprints count it).
"""
import socket

_state = {"hosts": None}


def gather(comm):
    """Every world rank's hostname (an MPI all-gather over ``comm``, the world; once)."""
    if _state["hosts"] is None:
        me = socket.gethostname()
        _state["hosts"] = list(comm.allgather(me)) if comm.Get_size() > 1 else [me]
    return _state["hosts"]


def hosts():
    """The hostname of every world rank (this host alone before ``gather``)."""
    return _state["hosts"] or [socket.gethostname()]


def host(rank):
    return hosts()[rank]


def names():
    """The nodes' hostnames, by node id (the order of their lowest world rank)."""
    out = []
    for h in hosts():
        if h not in out:
            out.append(h)
    return out


def node_of(rank):
    return names().index(host(rank))


def count():
    return len(names())


def spans(ranks):
    """The node ids the world ranks ``ranks`` run on, sorted."""
    return sorted({node_of(r) for r in ranks})


def placement(mesh):
    """{axis: where its groups lie} for each axis of ``mesh`` of size > 1: "inside a node" when
    each of this rank's groups of that axis stays on one node, else "across k nodes"."""
    out = {}
    hybrid = getattr(mesh, "dp_replicate_world_size", 1) > 1 and getattr(mesh, "dp_shard_world_size", 1) > 1
    for axis in ("tp", "cp", "dp", "dp_shard", "dp_replicate", "pp", "ep"):
        group = getattr(mesh, f"{axis}_group", None)
        if group is None or group.size <= 1 or (axis.startswith("dp_") and not hybrid):
            continue        # HSDP: where its shard groups and its replicas lie, too
        k = len(spans(group.ranks))
        out[axis] = "inside a node" if k == 1 else f"across {k} nodes"
    return out


def tp_split_needlessly(mesh):
    """True when this rank's tp group crosses nodes although every node holds a multiple of tp
    ranks (block placement would keep it inside one: mpiexec's default, ranks of a node numbered
    one after another)."""
    tp = mesh.tp_world_size
    if tp <= 1 or len(spans(mesh.tp_group.ranks)) == 1:
        return False
    per_node = [hosts().count(h) for h in names()]
    return all(k % tp == 0 for k in per_node)


__all__ = ["gather", "hosts", "host", "names", "node_of", "count", "spans", "placement", "tp_split_needlessly"]
