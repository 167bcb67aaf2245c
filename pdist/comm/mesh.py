"""DeviceMesh: the world as a 3-D grid (pp, dp, tp) of ranks, and its sub-groups.

Rank order (tp fastest-varying, then dp, then pp; Megatron's order, so the
tensor-parallel ranks, which talk most, are neighbours on a node):

    world_rank = (pp_rank * dp + dp_rank) * tp + tp_rank

For dp=2, tp=2 (4 ranks): tp groups {0,1} {2,3}; dp groups {0,2} {1,3}.
Each rank belongs to one group per axis: ``tp_group`` holds the ranks with its
(pp, dp) and varying tp, and so on. Groups are made with MPI ``Split`` (one
collective per axis, every rank calls it). ``coords`` is ``(pp, dp, tp)``.
"""
from collections import namedtuple

Coords = namedtuple("Coords", ["pp", "dp", "tp"])


class DeviceMesh:
    """World -> dp / tp / pp ProcessGroups for a (pp, dp, tp) grid of ranks."""

    def __init__(self, dp=1, tp=1, pp=1, world=None, topology=None, ep=1):
        """``topology``: simulate a cluster from now on (a spec string of
        pdist/comm/topology.py, e.g. "nodes=2x2,inter=12.5GB/s:10us"); None leaves it."""
        from pdist.comm.world import get_world
        world = world or get_world()
        if topology is not None:
            from pdist.comm import topology as topo
            topo.set(topology)
        n = world.size
        for name, v in (("dp", dp), ("tp", tp), ("pp", pp)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"DeviceMesh: {name}={v!r} must be a positive integer")
        if dp * tp * pp != n:
            raise ValueError(
                f"DeviceMesh(dp={dp}, tp={tp}, pp={pp}): dp*tp*pp = {dp * tp * pp} but the world has "
                f"{n} rank(s). Choose sizes whose product is {n} (e.g. dp={n // (tp * pp) if n % (tp * pp) == 0 else n}"
                f"{f', tp={tp}' if n % (tp * pp) == 0 and tp > 1 else ''}"
                f"{f', pp={pp}' if n % (tp * pp) == 0 and pp > 1 else ''}), or launch with mpirun -n {dp * tp * pp}.")
        self.world, self.dp_world_size, self.tp_world_size, self.pp_world_size = world, dp, tp, pp
        r = world.rank
        self.tp_rank, self.dp_rank, self.pp_rank = r % tp, (r // tp) % dp, r // (tp * dp)
        self.coords = Coords(self.pp_rank, self.dp_rank, self.tp_rank)
        self.tp_group = world.split(self.pp_rank * dp + self.dp_rank, self.tp_rank, "tp")
        self.dp_group = world.split(self.pp_rank * tp + self.tp_rank, self.dp_rank, "dp")
        self.pp_group = world.split(self.dp_rank * tp + self.tp_rank, self.pp_rank, "pp")
        self.pp_is_first_stage = self.pp_rank == 0
        self.pp_is_last_stage = self.pp_rank == pp - 1
        self.pp_prev_rank = None if self.pp_is_first_stage else self.pp_rank - 1
        self.pp_next_rank = None if self.pp_is_last_stage else self.pp_rank + 1
        self._expert_groups(ep)

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

    def rank_of(self, dp=0, tp=0, pp=0):
        """World rank of the grid point (pp, dp, tp)."""
        return (pp * self.dp_world_size + dp) * self.tp_world_size + tp

    @property
    def shape(self):
        return {"pp": self.pp_world_size, "dp": self.dp_world_size, "tp": self.tp_world_size}

    def __repr__(self):
        return (f"<DeviceMesh pp={self.pp_world_size} dp={self.dp_world_size} tp={self.tp_world_size}; "
                f"rank {self.world.rank} at {tuple(self.coords)}>")
