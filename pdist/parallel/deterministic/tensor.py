"""Tensor parallelism in the deterministic mode: every sum tp splits, in ``tp_blocks`` fixed blocks.

A tensor-parallel layout of t ranks splits four kinds of sums (blocks.py); in the mode each
is a balanced tree over b = ``tp_blocks`` fixed blocks, whatever the layout, so one process
computes the blocks a tp = b layout holds, and a tp rank of t holds b / t of them:

    ColumnParallelLinear   dX = sum_k dY_k A_k^T          ``BlockedColumn``  (a shared input: ``FanInput``)
    RowParallelLinear      Y  = sum_k X_k A_k             ``BlockedRow``     (its bias's db: in token blocks)
    the vocab-parallel loss sum_v exp(z_v - m)            ``BlockedVocabLoss``
    the norms              dw = sum over the tokens       ``TokenBlockLayerNorm``, ``TokenBlockRMSNorm``

``apply_blocks`` gives the layers the tensor-parallel transform built (transform.py) these
classes, each a subclass that overrides the one step it computes in blocks, after the
transform and before the first step, the way FSDP2 gives a module its class: the layers keep
their parameters, names and cuts. One process (``block_model``) runs the transform over a
group of one first. A tp rank's ``TensorParallel`` takes ``BlockedTensorParallel`` in front:
its sums over t > 2 ranks join in the tree's order (``TreeSums``, join.py), and under
sequence parallelism each granule's partial gradients are summed over tp before its leaf.
"""
from pdist import nn
from pdist.comm import default_group, self_group
from pdist.engine import precision
from pdist.engine.autograd import Tensor
from pdist.engine.backend import xp
from pdist.engine.index_checks import check_indices
from pdist.models.plan import get, plan_of, select
from pdist.parallel.deterministic.blocks import FanInput, blocked_column, blocked_row, token_bias
from pdist.parallel.deterministic.join import TreeSums
from pdist.parallel.deterministic.kernels import GranuleLayerNorm, GranuleRMSNorm, GranuleVocabCrossEntropy
from pdist.parallel.deterministic.policy import InMode
from pdist.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from pdist.parallel.tensor.regions import SharedInput
from pdist.parallel.tensor.transform import VocabParallelCrossEntropyLoss, transform


class BlockedColumn(ColumnParallelLinear):
    """Y = X A + b as ``blocks`` column blocks, dX their tree (blocks.blocked_column)."""

    blocks = 1

    def local_linear(self, x):
        if self.blocks > 1 or isinstance(x, list):        # a FanInput hands its slots
            return blocked_column(x, self.weight, self.bias, self.layout, self.dim, self.stride, self.blocks)
        return super().local_linear(x)


class BlockedRow(RowParallelLinear):
    """sum_k X_k A_k over ``blocks`` blocks of K; the bias's gradient in ``token_blocks`` of T."""

    blocks, token_blocks = 1, None

    def local_linear(self, x):
        if self.blocks > 1:
            return blocked_row(x, self.weight, self.layout, self.dim, self.blocks)   # (..., out) partial sum
        return super().local_linear(x)

    def add_bias(self, y):
        if self.bias is not None and self.token_blocks is not None:
            return token_bias(y, precision.weight(self.bias), self.token_blocks)
        return super().add_bias(y)


class BlockedVocabLoss(VocabParallelCrossEntropyLoss):
    """The vocab-parallel loss, its sum of exponentials over ``blocks`` blocks of this rank's V/t."""

    blocks = 1

    def forward(self, logits, targets):
        g = self.group
        targets = targets.data if isinstance(targets, Tensor) else xp.asarray(targets)
        check_indices(targets, logits.shape[-1] * g.size, "cross_entropy target")
        return GranuleVocabCrossEntropy.apply(logits, targets, group=g, vocab_start=g.rank * logits.shape[-1],
                                              blocks=self.blocks)


class TokenBlockLayerNorm(nn.LayerNorm):
    token_blocks = 1

    def forward(self, x):
        return GranuleLayerNorm.apply(x, precision.weight(self.weight), precision.weight(self.bias), eps=self.eps,
                                      token_blocks=self.token_blocks)


class TokenBlockRMSNorm(nn.RMSNorm):
    token_blocks = 1

    def forward(self, x):
        return GranuleRMSNorm.apply(x, precision.weight(self.weight), eps=self.eps, token_blocks=self.token_blocks)


_BLOCKED = {ColumnParallelLinear: BlockedColumn, RowParallelLinear: BlockedRow,
            VocabParallelCrossEntropyLoss: BlockedVocabLoss}
_TOKEN_BLOCKED = {nn.LayerNorm: TokenBlockLayerNorm, nn.RMSNorm: TokenBlockRMSNorm, RowParallelLinear: BlockedRow}


def _give(m, table, **attrs):
    """m's class becomes table's subclass of it (kept if it is one already); then ``attrs``."""
    cls = next((c for base, c in table.items() if isinstance(m, base)), None)
    if cls is None:
        return False
    if not isinstance(m, cls):
        m.__class__ = cls
    for k, v in attrs.items():
        setattr(m, k, v)
    return True


def apply_blocks(model, plan, blocks, token_blocks):
    """The transformed ``model``'s layers compute in ``blocks`` blocks per rank (a shared input's
    gradient in the ``Fan``'s order), and the modules of the plan's ``sequence_partial``
    parameters (norms, row biases) sum their parameters' gradients over ``token_blocks``
    blocks of this rank's tokens (blocks.py)."""
    for _, m in model.named_modules():
        if _give(m, _BLOCKED, blocks=blocks) and getattr(m, "shared_input", None) is not None:
            _give(m.shared_input, {SharedInput: FanInput}, blocks=blocks)
    named = list(model.named_parameters())
    for path in {n.rpartition(".")[0] for pattern in plan.sequence_partial for n, _ in select(pattern, named)}:
        _give(get(model, path), _TOKEN_BLOCKED, token_blocks=token_blocks)


def blockable(model, blocks):
    """True when the mode's one process can compute ``model``'s tensor-parallel sums in ``blocks``
    fixed blocks: its plan cuts layers, no experts, and every cut size divides by ``blocks``
    (heads, widths, the vocabulary)."""
    plan = plan_of(model)
    if not plan.tensor or plan.experts:
        return False
    return all(n % blocks == 0 for n in plan.tp_sizes.values())


def block_model(model, blocks):
    """The mode's one-process form of ``model`` (in place): its plan's layers as the
    tensor-parallel ones over a group of one, each computing ``blocks`` blocks. A model
    ``blockable`` refuses is left as it is (tensor parallelism is then refused in the mode)."""
    if blocks > 1 and blockable(model, blocks):
        plan = plan_of(model)
        transform(model, plan, self_group(), False)
        apply_blocks(model, plan, blocks, blocks)
    return model


def check_tp(det, tp, model, sequence_parallel=False):
    """What the mode refuses under tensor parallelism over ``tp`` ranks (``model``: a model or
    its config), each with its reason; the same on every rank, before any collective."""
    b = det.tp_blocks
    if tp > b:
        raise ValueError(f"deterministic mode computes every tensor-parallel sum in tp_blocks = {b} fixed "
                         f"blocks, so it accepts tp <= {b} (got tp = {tp}): a rank holds whole blocks. Pass "
                         f"deterministic=dict(tp_blocks={tp}) (one process then computes {tp} blocks), use "
                         f"tp <= {b}, or deterministic=False")
    if b % tp:
        raise ValueError(f"deterministic mode: tp = {tp} does not divide the {b} fixed blocks; use tp in "
                         f"{[d for d in range(1, b + 1) if b % d == 0]}")
    if not blockable(model, b):
        plan = plan_of(model)
        bad = {k: n for k, n in plan.tp_sizes.items() if n % b}
        why = (f"its cut sizes {bad} are not divisible by tp_blocks = {b} (one process computes every "
               f"tensor-parallel sum in {b} blocks); choose sizes divisible by {b} or a smaller tp_blocks "
               f"(>= tp)" if plan.tensor and not plan.experts else "its plan cuts no layer (or cuts experts)")
        raise ValueError(f"deterministic mode cannot give tensor parallelism one process's bits for "
                         f"{type(model).__name__}: {why}. Or use tp = 1, or deterministic=False")


class BlockedTensorParallel(InMode):
    """``TensorParallel`` in the mode: what the mode refuses, checked before any collective; the
    layers in blocks (``tp_blocks`` / t per rank); the tp sums over t > 2 ranks in the tree's
    order; under SP each granule's partial gradients summed over tp before its leaf."""

    def __init__(self, module, group=None, sequence_parallel=False):
        t = default_group(group).size
        if t > 1:
            check_tp(module.deterministic, t, module.module, sequence_parallel)
        super().__init__(module, group, sequence_parallel)
        if t > 1:
            self.deterministic.bind(self.inner.parameters())      # this rank's shards, for the leaves

    def _transform(self, model, g, sp):
        det, t = self.deterministic, g.size
        g = TreeSums(g) if t > 2 else g     # t partials joined as the tree (t = 2: one order already)
        super()._transform(model, g, sp)
        apply_blocks(model, self.plan, det.tp_blocks // t, det.tp_blocks // t if sp else det.tp_blocks)
        if sp:                              # each granule's partial grads, summed over tp before its leaf
            det.granule_hooks.append(lambda: self.sum_partials(g))

    def finish_grad_sync(self):
        self.inner.finish_grad_sync()       # (SP's partial sums ran per granule, a granule hook)


__all__ = ["BlockedColumn", "BlockedRow", "BlockedVocabLoss", "TokenBlockLayerNorm", "TokenBlockRMSNorm",
           "apply_blocks", "blockable", "block_model", "check_tp", "BlockedTensorParallel"]
