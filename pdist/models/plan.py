"""A model's parallel plan, held as data: which cut each layer takes under each strategy.

A strategy never names a model's layer. It reads the model's plan (``model.parallel_plan()``,
written next to the model: pdist/models/gpt_plan.py, llama_plan.py), the way torchtitan's
models bring a sharding plan and Megatron's layers record ``partition_dim``:

    tensor            {module pattern: style}   Column(stride), Row(), Vocab(), VocabLoss()
                      Column/Row split a Linear's output/input features (Megatron, Shoeybi et
                      al. 2019); Vocab splits an Embedding's rows; VocabLoss is the loss over
                      vocabulary-sharded logits; ``Column(tied_to=...)`` shares the (already
                      vocab-parallel) weight of another module (GPT-2's head and embedding)
    heads             {module pattern: attribute names}  head counts each tp rank divides by t
    tp_sizes          {what: size}  every size that must divide by the tp size (checked first)
    sequence          {module pattern: style}   PositionShard(), DropoutShard(): the modules
                      that hold T/t tokens under sequence parallelism (Korthikanti et al. 2022)
    sequence_partial  parameter patterns whose gradients are partial sums under SP
    pipeline          PipelinePlan: first part, blocks, last part, tied pairs, activation width
    zero_units        module patterns, in forward order: ZeRO/FSDP's units (the rest is the root)
    experts           {module pattern: Experts()}  the MoE layers (pdist/models/moe.py): their
                      ``experts.{e}`` parameters are the experts that expert parallelism splits
                      over the ep ranks (E/ep each); the rest of the layer (the gate) is dense

A pattern is a dotted module or parameter path; ``*`` stands for one whole path segment
(``transformer.h.*.attn`` matches ``transformer.h.3.attn``). ``nn.Sequential`` has the
trivial plan: its children are the pipeline's blocks, nothing else is cut.
"""
from dataclasses import dataclass, field
from fnmatch import fnmatchcase


@dataclass(frozen=True)
class Column:
    """Y = X A, A split by output features; ``stride`` fused parts split separately
    ([Q|K|V]: 3); ``tied_to``: the module whose vocab-parallel weight this layer shares;
    ``shared_input``: a name; the column layers of one parent module with the same name
    read one input through one f (Megatron's fused [Q|K|V] or [gate|up] input)."""
    stride: int = 1
    tied_to: str = None
    shared_input: str = None


@dataclass(frozen=True)
class Row:
    """Y = X A, A split by input features; one all-reduce (SP: reduce-scatter), bias once."""


@dataclass(frozen=True)
class Vocab:
    """y = W[idx], W split by rows (the vocabulary)."""


@dataclass(frozen=True)
class VocabLoss:
    """Cross-entropy of vocabulary-sharded logits: no rank holds the full logits."""


@dataclass(frozen=True)
class PositionShard:
    """A position embedding read at this rank's T/t positions (sequence parallelism)."""


@dataclass(frozen=True)
class DropoutShard:
    """Dropout on this rank's T/t tokens with the single-process mask (sequence parallelism)."""


@dataclass(frozen=True)
class Experts:
    """An MoE layer of ``n_expert`` experts held in its ModuleList ``experts``: expert
    parallelism keeps experts [r E/ep, (r+1) E/ep) on ep rank r; their gradients are reduced
    over the ranks that hold the same expert, the gate's over dp (Lepikhin et al. 2020)."""
    n_expert: int = 0
    attr: str = "experts"


@dataclass(frozen=True)
class PipelinePlan:
    """The model as [first] + blocks + [last] (pdist/parallel/pipeline). ``first``/``last``:
    the model's methods that virtual stage 0 / V-1 run (embedding; final norm and head);
    ``first_modules``/``last_modules``: what only those stages hold; ``blocks``: the module
    list path ("" = the model itself); ``loss``: the loss module, on the last stage;
    ``tied``: {the last stage's own copy: the parameter it stays equal to}; ``hidden``: the
    activation width between blocks."""
    blocks: str = ""
    first: str = None
    last: str = None
    first_modules: tuple = ()
    last_modules: tuple = ()
    loss: str = None
    tied: dict = field(default_factory=dict)
    hidden: int = 0


@dataclass(frozen=True)
class ModelPlan:
    tensor: dict = field(default_factory=dict)
    heads: dict = field(default_factory=dict)
    tp_sizes: dict = field(default_factory=dict)
    sequence: dict = field(default_factory=dict)
    sequence_partial: tuple = ()
    pipeline: PipelinePlan = PipelinePlan()
    zero_units: tuple = ()
    experts: dict = field(default_factory=dict)


def matches(pattern, path):
    """``pattern`` matches dotted ``path`` segment by segment (``*``: one whole segment)."""
    a, b = pattern.split("."), path.split(".")
    return len(a) == len(b) and all(fnmatchcase(s, p) for p, s in zip(a, b))


def select(pattern, named):
    """[(name, x)] of ``named`` whose name matches ``pattern``, in their order."""
    return [(n, x) for n, x in named if matches(pattern, n)]


def get(root, path):
    """The attribute at dotted ``path`` below ``root`` ("" = root)."""
    for part in filter(None, path.split(".")):
        root = getattr(root, part)
    return root


def put(root, path, value):
    """Set the attribute at dotted ``path`` below ``root`` (a module or a parameter)."""
    parent, _, name = path.rpartition(".")
    setattr(get(root, parent), name, value)


def tp_split(plan, name):
    """True when tensor parallelism splits parameter ``name`` over the tp ranks (a Column's
    weight and bias, a Row's weight, a Vocab's rows); False when it is replicated."""
    module, _, leaf = name.rpartition(".")
    for pattern, style in plan.tensor.items():
        if matches(pattern, module):
            return isinstance(style, (Column, Vocab)) or (isinstance(style, Row) and leaf == "weight")
    return False


def expert_of(plan, name):
    """(MoE layer path, expert id) when parameter ``name`` belongs to an expert of one of the
    plan's MoE layers (``<layer>.experts.<e>.<...>``), else None (a dense parameter)."""
    parts = name.split(".")
    for pattern, style in plan.experts.items():
        n = len(pattern.split("."))
        if len(parts) > n + 2 and parts[n] == style.attr and matches(pattern, ".".join(parts[:n])):
            return ".".join(parts[:n]), int(parts[n + 1])
    return None


def plan_of(model):
    """The plan a model (or a config) brings: ``model.parallel_plan()``. Any other module has
    the trivial plan (nothing cut; an ``nn.Sequential``'s children are pipeline blocks); a
    strategy that needs a cut the plan lacks says so (docs/design.md, "Adding a model")."""
    return model.parallel_plan() if hasattr(model, "parallel_plan") else ModelPlan()


__all__ = ["ModelPlan", "PipelinePlan", "Column", "Row", "Vocab", "VocabLoss", "PositionShard",
           "DropoutShard", "Experts", "matches", "select", "get", "put", "plan_of", "tp_split", "expert_of"]
