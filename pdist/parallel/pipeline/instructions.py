"""The instructions of a pipeline schedule, and where each virtual stage lives.

A model cut into V = p*v consecutive *virtual stages* runs on p ranks; rank s
holds the v model chunks c = 0..v-1. The *placement* says which virtual stage a
chunk is:

    "loop"  k = c*p + s (Megatron's interleaved assignment; v = 1 is the plain pipeline)
    "v"     v = 2: chunk 0 of rank s is stage s, chunk 1 is stage 2p-1-s (ZB-V, Qi et al.,
            2024; DualPipeV, DeepSeek-AI, 2024): rank 0 holds the first and the last
            stage, a micro-batch walks down the ranks and back up (a V), and rank p-1
            hands stage p-1 to stage p by a message to itself (a local copy).

A training step over m micro-batches is, on every rank, a list of ``Instr``:

    FORWARD(mb, chunk)          the forward of that micro-batch through that chunk
    BACKWARD(mb, chunk)         the whole backward
    BACKWARD_INPUT(mb, chunk)   "B": dL/d(input) only -- what the previous stage waits for
    BACKWARD_WEIGHT(mb, chunk)  "W": that (mb, chunk)'s weight gradients, no messages
    RECV_ACT / SEND_ACT   (mb, chunk, peer)   activations, k-1 -> k -> k+1
    RECV_GRAD / SEND_GRAD (mb, chunk, peer)   gradients,   k+1 -> k -> k-1
    OPTIMIZER_STEP              last, after every backward

BACKWARD_INPUT then BACKWARD_WEIGHT is BACKWARD split in two (Qi et al., 2024, "Zero
Bubble Pipeline Parallelism"): B is preceded by RECV_GRAD and followed by SEND_GRAD
like BACKWARD; W may run any time after its B and fills the bubble.
"""
from collections import namedtuple

FORWARD, BACKWARD = "FORWARD", "BACKWARD"
BACKWARD_INPUT, BACKWARD_WEIGHT = "BACKWARD_INPUT", "BACKWARD_WEIGHT"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"
OPTIMIZER_STEP = "OPTIMIZER_STEP"
COMPUTE = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
PASSES = {FORWARD: "forward", BACKWARD: "backward", BACKWARD_INPUT: "backward_input",   # a compute's span name
          BACKWARD_WEIGHT: "backward_weight"}
COMM = (SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD)


class Instr(namedtuple("Instr", ["op", "mb", "chunk", "peer"])):
    """One step of a stage's program; ``peer`` is the pp rank sent to / received from."""
    __slots__ = ()

    def __new__(cls, op, mb=None, chunk=0, peer=None):
        return super().__new__(cls, op, mb, chunk, peer)

    def __repr__(self):
        if self.op == OPTIMIZER_STEP:
            return "STEP"
        peer = "" if self.peer is None else f"->{self.peer}" if self.op.startswith("SEND") else f"<-{self.peer}"
        return f"{self.op}({self.mb}.{self.chunk}{peer})"


V_SHAPED = ("zb-v", "dualpipev")
PLACEMENTS = ("loop", "v")


def placement_of(name):
    """The placement schedule ``name`` runs on: "v" for zb-v and dualpipev, else "loop"."""
    return "v" if name in V_SHAPED else "loop"


def virtual_stage(chunk, p, s, placement="loop"):
    """The virtual stage k that model chunk ``chunk`` of pp rank s is: "loop" k = chunk*p + s;
    "v" (two chunks) k = s for chunk 0 and 2p-1-s for chunk 1."""
    if placement == "loop":
        return chunk * p + s
    if placement != "v" or chunk not in (0, 1):
        raise ValueError(f"placement {placement!r}, chunk {chunk!r}: placements are {PLACEMENTS} "
                         "and the 'v' placement has chunks 0 and 1 only")
    return s if chunk == 0 else 2 * p - 1 - s


def stage_owner(k, p, placement="loop"):
    """(rank, chunk) holding virtual stage k: the inverse of ``virtual_stage``."""
    if placement == "loop":
        return k % p, k // p
    if placement != "v" or not 0 <= k < 2 * p:
        raise ValueError(f"placement {placement!r}: no virtual stage {k} (placements {PLACEMENTS}; "
                         f"'v' has stages 0..{2 * p - 1})")
    return (k, 0) if k < p else (2 * p - 1 - k, 1)


def schedule_placement(schedule):
    """A schedule's placement: its ``.placement`` (``Schedule``), "loop" for a plain list."""
    return getattr(schedule, "placement", "loop")


class Schedule(list):
    """One instruction list per pp rank, with the ``placement`` its chunks use and its ``name``."""

    def __init__(self, programs, placement="loop", name=None):
        super().__init__(programs)
        self.placement, self.name = placement, name


class DeadlockError(RuntimeError):
    pass


def message_key(s, ins, p, placement="loop"):
    """What identifies a message: (kind, mb, receiving virtual stage), and the (rank, chunk)
    it goes to."""
    k = virtual_stage(ins.chunk, p, s, placement)
    if ins.op == SEND_ACT:
        return ("act", ins.mb, k + 1), stage_owner(k + 1, p, placement)
    if ins.op == RECV_ACT:
        return ("act", ins.mb, k), (s, ins.chunk)
    if ins.op == SEND_GRAD:
        return ("grad", ins.mb, k - 1), stage_owner(k - 1, p, placement)
    return ("grad", ins.mb, k), (s, ins.chunk)


def _check_args(p, m, v=1):
    for name, val in (("p (pipeline stages)", p), ("m (micro-batches)", m), ("v (chunks per rank)", v)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"schedule: {name} must be a positive integer, got {val!r}")


def _program(p, s, v, order, placement="loop"):
    """Expand a compute order [(op, mb, chunk)] of rank s into instructions, with
    each receive right before the compute that needs it and each send right after
    the compute that produced it (BACKWARD_WEIGHT neither receives nor sends)."""
    V, prog = p * v, []
    for op, mb, c in order:
        k = virtual_stage(c, p, s, placement)
        if op == FORWARD:
            if k > 0:
                prog.append(Instr(RECV_ACT, mb, c, stage_owner(k - 1, p, placement)[0]))
            prog.append(Instr(FORWARD, mb, c))
            if k < V - 1:
                prog.append(Instr(SEND_ACT, mb, c, stage_owner(k + 1, p, placement)[0]))
        elif op == BACKWARD_WEIGHT:
            prog.append(Instr(BACKWARD_WEIGHT, mb, c))
        else:
            if k < V - 1:
                prog.append(Instr(RECV_GRAD, mb, c, stage_owner(k + 1, p, placement)[0]))
            prog.append(Instr(op, mb, c))
            if k > 0:
                prog.append(Instr(SEND_GRAD, mb, c, stage_owner(k - 1, p, placement)[0]))
    prog.append(Instr(OPTIMIZER_STEP))
    return prog
