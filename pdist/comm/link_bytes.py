"""The bytes a step sends between nodes, by formula, from pdist's own per-group counts.

A group of n ranks spread over k nodes, g of them on this rank's node, runs collectives of S
bytes (the full tensor; ``ProcessGroup.stats`` counts each rank's ring-accounted bytes,
docs/design.md). Two formulas for what leaves a node:

    ring     every rank sends its ring-accounted bytes to its successor in the group; the
             ranks whose successor sits on another node put theirs on the link. What a flat
             ring sends; exact for any algorithm when n = 2.
    least    what any algorithm must send, a node reducing or relaying inside itself first:
             all-reduce 2(k-1)/k S per node (the node-level all-reduce of the node's sum;
             Patarasuk & Yuan, 2009, applied to nodes), all-gather g S/n (this node's shards,
             at least once), reduce-scatter (n-g) S/n (the partial sums of the shards the
             other nodes own), send/recv its bytes when the peer is on another node.

A node-aware MPI (MPICH's SMP-aware all-reduce: reduce inside the node, all-reduce between
node leaders, broadcast inside) reaches ``least``; a flat ring sends ``ring``; recursive
doubling or halving can send more than both. The kernel's interface counter (what the box's
nodes read, pdist.cluster) is what was really sent, plus TCP/IP framing.

Each rank returns its own share of its node's bytes (``least`` split evenly over the node's g
members), so summing over the ranks of a node gives the node's bytes.
"""
RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: (n - 1) / n}


def _least(op, S, n, g, k):
    if op == "all_reduce":
        return 2 * (k - 1) / k * S / g
    if op == "all_gather":
        return S / n
    if op == "reduce_scatter":
        return (n - g) / n * S / g
    return None


def crossing(groups, node_of, rank, steps=1):
    """{"ring", "least"}: bytes per step that this ``rank`` (a world rank) puts on the links
    between nodes, by each formula (module doc). ``groups``: the ProcessGroups the step used;
    ``node_of``: world rank -> node id. Send/recv and unknown ops count their bytes in both
    when the group spans nodes (an upper bound for ``least``)."""
    ring = least = 0.0
    for grp in groups:
        n, members = grp.size, list(grp.ranks)
        if n < 2 or len({node_of(r) for r in members}) < 2:
            continue
        k = len({node_of(r) for r in members})
        g = sum(node_of(r) == node_of(rank) for r in members)
        succ = members[(members.index(rank) + 1) % n]
        for op, v in grp.stats.items():
            b = v["bytes"] / steps
            if node_of(succ) != node_of(rank):
                ring += b
            f = RING_FACTOR.get(op)
            low = None if f is None else _least(op, b / f(n), n, g, k)
            least += b if low is None else low
    return {"ring": ring, "least": least}
