"""DeviceMesh: the world as a 3-D grid (pp, dp, tp) of ranks, and its sub-groups.

Rank order (tp fastest-varying, then cp, then dp, then pp; Megatron's tp-cp-dp-pp, so
the tensor-parallel ranks, which talk most, are neighbours on a node):

    world_rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

Hybrid sharding (HSDP) splits dp = dp_replicate x dp_shard, dp_shard the faster:

    dp_rank = dp_replicate_rank * dp_shard + dp_shard_rank

so with ranks placed on nodes in blocks, a ``dp_shard_group`` (the dp ranks with the same
dp_replicate_rank) sits inside a node and a ``dp_replicate_group`` (the same dp_shard_rank)
goes across them (pdist/parallel/zero/hsdp.py). ``DeviceMesh(dp=4)`` is dp_replicate 1,
dp_shard 4; with dp_replicate = 1 the shard group is ``dp_group`` and the replicate group
this process alone, with dp_shard = 1 the other way round.

``cp`` (context parallelism, default 1) cuts every sequence; its ranks hold the same rows
of the batch, so gradients are reduced over ``dp_cp_group`` (dp x cp ranks; ZeRO shards
over it, as Megatron and torchtitan do). With cp = 1 it is ``dp_group``.

For dp=2, tp=2 (4 ranks): tp groups {0,1} {2,3}; dp groups {0,2} {1,3}. On nodes of
R ranks numbered in blocks (node k holds world ranks kR .. kR+R-1, mpiexec's default placement)
a tp group stays inside a node whenever tp divides R: tp is the fastest-varying coordinate.
``placement()`` says where each axis lies, from the ranks' hostnames (pdist/comm/nodes.py), and
a tp group that crosses nodes needlessly is warned about at construction.
Each rank belongs to one group per axis: ``tp_group`` holds the ranks with its
(pp, dp) and varying tp, and so on. Groups are made with MPI ``Split`` (one
collective per axis, every rank calls it). ``coords`` is ``(pp, dp, tp)``.
"""
from collections import namedtuple

Coords = namedtuple("Coords", ["pp", "dp", "tp"])


class DeviceMesh:
    """World -> dp / tp / pp ProcessGroups for a (pp, dp, tp) grid of ranks."""

    def __init__(self, dp=None, tp=1, pp=1, world=None, topology=None, cp=1, ep=1, dp_replicate=None,
                 dp_shard=None):
        """``topology``: simulate a cluster from now on (a spec string of
        pdist/comm/topology.py, e.g. "nodes=2x2,inter=12.5GB/s:10us"); None leaves it.
        ``dp_replicate``, ``dp_shard``: hybrid sharding's split of dp (module docstring); the
        one not given follows from ``dp`` (or is 1); dp defaults to their product (or 1)."""
        from pdist.comm.world import get_world
        dp, self.dp_replicate_world_size, self.dp_shard_world_size = split_dp(dp, dp_replicate, dp_shard)
        world = world or get_world()
        if topology is not None:
            from pdist.comm import topology as topo
            topo.set(topology)
        n = world.size
        for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"DeviceMesh: {name}={v!r} must be a positive integer")
        if cp > 1 and dp * tp * pp * cp != n:
            raise ValueError(f"DeviceMesh(dp={dp}, cp={cp}, tp={tp}, pp={pp}): dp*cp*tp*pp = {dp * cp * tp * pp} "
                             f"but the world has {n} rank(s). Choose sizes whose product is {n}, or launch "
                             f"with mpirun -n {dp * cp * tp * pp}.")
        if cp == 1 and dp * tp * pp != n:
            raise ValueError(
                f"DeviceMesh(dp={dp}, tp={tp}, pp={pp}): dp*tp*pp = {dp * tp * pp} but the world has "
                f"{n} rank(s). Choose sizes whose product is {n} (e.g. dp={n // (tp * pp) if n % (tp * pp) == 0 else n}"
                f"{f', tp={tp}' if n % (tp * pp) == 0 and tp > 1 else ''}"
                f"{f', pp={pp}' if n % (tp * pp) == 0 and pp > 1 else ''}), or launch with mpirun -n {dp * tp * pp}.")
        self.world, self.dp_world_size, self.tp_world_size, self.pp_world_size = world, dp, tp, pp
        self.cp_world_size = cp
        r = world.rank
        self.tp_rank, self.cp_rank = r % tp, (r // tp) % cp
        self.dp_rank, self.pp_rank = (r // (tp * cp)) % dp, r // (tp * cp * dp)
        self.coords = Coords(self.pp_rank, self.dp_rank, self.tp_rank)
        c, d, t, p = self.cp_rank, self.dp_rank, self.tp_rank, self.pp_rank
        self.tp_group = world.split((p * dp + d) * cp + c, t, "tp")
        self.dp_group = world.split((p * cp + c) * tp + t, d, "dp")
        self.pp_group = world.split((d * cp + c) * tp + t, p, "pp")
        self._split_cp(world)
        self._split_hybrid()
        self.pp_is_first_stage = self.pp_rank == 0
        self.pp_is_last_stage = self.pp_rank == pp - 1
        self.pp_prev_rank = None if self.pp_is_first_stage else self.pp_rank - 1
        self.pp_next_rank = None if self.pp_is_last_stage else self.pp_rank + 1
        self._expert_groups(ep)
        self._check_nodes()

    def _check_nodes(self):
        """On several nodes (by hostname, pdist/comm/nodes.py), warn (world rank 0) when the tp
        group crosses nodes although block placement would keep it inside one."""
        from pdist.comm import nodes
        if nodes.count() > 1 and self.world.rank == 0 and nodes.tp_split_needlessly(self):
            import warnings
            warnings.warn(f"DeviceMesh: tp group (world ranks {list(self.tp_group.ranks)}) crosses nodes "
                          f"{[nodes.names()[i] for i in nodes.spans(self.tp_group.ranks)]}: number the ranks "
                          f"of a node one after another (block placement: mpiexec's default, srun's "
                          f"--distribution=block) so that tp stays on a node's fast links", stacklevel=3)

    def placement(self):
        """{axis: "inside a node" | "across k nodes"} for this rank's groups (pdist/comm/nodes.py)."""
        from pdist.comm import nodes
        return nodes.placement(self)

    def _expert_groups(self, ep):
        """Expert parallelism inside the dp group (GShard; Megatron's expert groups): ep divides
        dp; ``ep_group`` = the dp ranks with the same dp_rank // ep (they split the experts,
        E/ep each, ep_rank = dp_rank % ep); ``edp_group`` = the dp ranks with the same ep_rank
        (the dp/ep replicas of each expert, over which its gradient is reduced). ep = 1: no
        ep group (None), edp_group = dp_group."""
        dp = self.dp_world_size
        if not isinstance(ep, int) or ep < 1 or dp % ep:
            raise ValueError(f"DeviceMesh: ep={ep!r} must be a positive integer dividing dp={dp} "
                             f"(expert parallelism splits each data-parallel group's experts)")
        self.ep_world_size, self.ep_rank = ep, self.dp_rank % ep
        if ep == 1:
            self.ep_group, self.edp_group = None, self.dp_group
            return
        self.ep_group = self.dp_group.split(self.dp_rank // ep, self.dp_rank, "ep")
        self.edp_group = self.dp_group.split(self.ep_rank, self.dp_rank, "edp")

    def _split_hybrid(self):
        """dp_shard_group (same dp_replicate_rank) and dp_replicate_group (same dp_shard_rank),
        split from dp_group; a size-1 one is this process alone and the other is dp_group.
        ``dp_shard_cp_group``: the shard group with its cp ranks (same pp, tp, dp_replicate_rank),
        the first dp_shard·cp of the dp·cp ranks: ZeRO shards over it under context parallelism."""
        from pdist.comm.world import self_group
        R, S, d = self.dp_replicate_world_size, self.dp_shard_world_size, self.dp_rank
        self.dp_replicate_rank, self.dp_shard_rank = d // S, d % S
        if R == 1 or S == 1:
            self.dp_shard_group = self.dp_group if R == 1 else self_group()
            self.dp_replicate_group = self.dp_group if S == 1 else self_group()
        else:
            self.dp_shard_group = self.dp_group.split(self.dp_replicate_rank, self.dp_shard_rank, "dp_shard")
            self.dp_replicate_group = self.dp_group.split(self.dp_shard_rank, self.dp_replicate_rank, "dp_replicate")
        cp, tp = self.cp_world_size, self.tp_world_size
        if cp == 1 or R == 1:
            self.dp_shard_cp_group = self.dp_shard_group if cp == 1 else self.dp_cp_group
            return
        self.dp_shard_cp_group = self.world.split((self.pp_rank * R + self.dp_replicate_rank) * tp + self.tp_rank,
                                                  self.dp_shard_rank * cp + self.cp_rank, "dp_shard_cp")

    def _split_cp(self, world):
        """cp_group (same pp, dp, tp) and dp_cp_group (same pp, tp); with cp = 1 no split:
        this process alone, and dp_group."""
        cp, tp, p, t = self.cp_world_size, self.tp_world_size, self.pp_rank, self.tp_rank
        if cp == 1:
            from pdist.comm.world import self_group
            self.cp_group, self.dp_cp_group = self_group(), self.dp_group
            return
        self.cp_group = world.split((p * self.dp_world_size + self.dp_rank) * tp + t, self.cp_rank, "cp")
        self.dp_cp_group = world.split(p * tp + t, self.dp_rank * cp + self.cp_rank, "dp_cp")

    def rank_of(self, dp=0, tp=0, pp=0, cp=0):
        """World rank of the grid point (pp, dp, cp, tp)."""
        return ((pp * self.dp_world_size + dp) * self.cp_world_size + cp) * self.tp_world_size + tp

    @property
    def shape(self):
        out = {"pp": self.pp_world_size, "dp": self.dp_world_size, "tp": self.tp_world_size}
        if self.cp_world_size > 1:
            out["cp"] = self.cp_world_size
        if self.dp_replicate_world_size > 1:       # HSDP: dp = dp_replicate x dp_shard
            out.update(dp_replicate=self.dp_replicate_world_size, dp_shard=self.dp_shard_world_size)
        return out

    def __repr__(self):
        cp = f" cp={self.cp_world_size}" if self.cp_world_size > 1 else ""
        R, S = self.dp_replicate_world_size, self.dp_shard_world_size
        hy = f" (dp_replicate={R} x dp_shard={S})" if R > 1 else ""
        return (f"<DeviceMesh pp={self.pp_world_size} dp={self.dp_world_size}{hy}{cp} tp={self.tp_world_size}; "
                f"rank {self.world.rank} at {tuple(self.coords)}>")


def split_dp(dp, dp_replicate, dp_shard):
    """(dp, dp_replicate, dp_shard) from what was given: dp alone is (dp, 1, dp); a missing
    split size follows from dp (or is 1); sizes that disagree raise one clear error."""
    given = {k: v for k, v in (("dp", dp), ("dp_replicate", dp_replicate), ("dp_shard", dp_shard)) if v is not None}
    for k, v in given.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"DeviceMesh: {k}={v!r} must be a positive integer")
    R, S = dp_replicate, dp_shard
    if R is None and S is None:
        return (dp or 1), 1, (dp or 1)
    if dp is not None and R is None and dp % S == 0:
        R = dp // S
    if dp is not None and S is None and dp % R == 0:
        S = dp // R
    R, S = R or 1, S or 1
    if dp is not None and R * S != dp:
        raise ValueError(f"DeviceMesh({', '.join(f'{k}={v}' for k, v in given.items())}): dp must equal "
                         f"dp_replicate * dp_shard (= {R * S}). Give dp_replicate and dp_shard alone (dp is "
                         f"their product), or dp alone (plain ZeRO/DDP over all of it).")
    return R * S, R, S
