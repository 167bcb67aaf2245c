"""``parallelize``: one model (GPT, Llama), any (dp, cp, tp, pp, ep) mesh, one model of the one shape.

    mesh = DeviceMesh(dp=2, tp=2, pp=2)
    model = parallelize(GPT(cfg, seed), mesh, zero_stage=1, sequence_parallel=True,
                        schedule="1f1b", microbatches=8)

builds, from the inside out (each strategy wraps the one before; base.py):

    TensorParallel(GPT, mesh.tp_group, sequence_parallel)    swaps layers: shards of every matrix
    PipelineParallel(.., mesh.pp_group, schedule, m, chunks) keeps this stage's blocks, runs the schedule
                                                             ("gpipe", "1f1b", "interleaved", and the zero-bubble
                                                             "zb-h1", "zb-v", "dualpipev": chunks 2 for the V ones)
    DataParallel / ZeRO(.., mesh.dp_group, zero_stage)       averages (reduce-scatters) the gradients
    HSDP(.., mesh.dp_shard_group, mesh.dp_replicate_group)   dp_replicate > 1, zero_stage >= 1: ZeRO inside each
                                                             shard group (x cp), shards averaged across replicas
    ExpertParallel(.., mesh, zero_stage)                     n_expert > 0, in DDP's place: E/ep experts per rank,
                                                             tokens over all_to_all_v (expert_parallel.py); with
                                                             ZeRO it holds ZeRO: dense units over dp, experts over edp
    ContextParallel(.., mesh, context_parallel)              cp > 1: cuts each sequence over the cp ranks,
                                                             DDP/ZeRO then span dp x cp (context/);
                                                             attention on this tp rank's heads, in every stage
    MixedPrecision(.., precision)                            bf16/fp16: fp32 masters, outermost

Each layer is left out where its size is 1 (microbatches then go to the plain model
as gradient accumulation). Per rank, Megatron's 3-D parallelism (Narayanan et al.,
2021): the tp group splits every layer, the pp group every stack of layers, the dp
group every batch; the gradient of each piece is complete after its tp and pp syncs
and is then averaged over dp. Every bad layout raises on every rank, before any
collective, with one clear message.
"""
from pdist.parallel.base import Local
from pdist.parallel.context import ContextParallel, check_context, install
from pdist.parallel.mixed_precision import MixedPrecision
from pdist.parallel.data_parallel import DataParallel, DataParallelNaive
from pdist.parallel.expert_parallel import ExpertParallel
from pdist.parallel.pipeline.pipeline_parallel import PipelineParallel, default_chunks
from pdist.parallel.pipeline.stages import partition_layers
from pdist.parallel.pipeline.schedules import make_schedule
from pdist.parallel.tensor.tensor_parallel import TensorParallel, check_tp_config
from pdist.parallel.zero import HSDP, STAGES, ZeRO, check_hybrid
from pdist.parallel.zero.zero import check_stage_with_pipeline
from pdist.engine.precision import cast_module, low_dtype, policy_for
from pdist.parallel.deterministic import Deterministic, check_layout as check_deterministic


def check_layout(cfg, mesh, zero_stage=0, sequence_parallel=False, schedule="1f1b", microbatches=1,
                 chunks=1, data_parallel="bucketed", precision="fp32"):
    """Every error a layout can have, raised the same on every rank before any collective."""
    dp, tp, pp = mesh.dp_world_size, mesh.tp_world_size, mesh.pp_world_size
    chunks = default_chunks(schedule, chunks)             # "zb-v", "dualpipev": 2 chunks per rank
    low_dtype(precision)                                  # an unknown precision raises here
    if zero_stage not in STAGES:
        raise ValueError(f"zero_stage must be one of {STAGES}, got {zero_stage!r}")
    if data_parallel not in ("bucketed", "naive"):
        raise ValueError(f"data_parallel must be 'bucketed' or 'naive', got {data_parallel!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    cp = getattr(mesh, "cp_world_size", 1)
    if getattr(cfg, "n_expert", 0):
        check_moe_layout(cfg, tp, pp, cp, sequence_parallel)
    if getattr(mesh, "ep_world_size", 1) > 1 and not getattr(cfg, "n_expert", 0):
        raise ValueError(f"ep={mesh.ep_world_size} needs a mixture-of-experts model (n_expert > 0 in the config)")
    check_hybrid(cfg, mesh, zero_stage)
    check_tp_config(cfg, tp)
    if sequence_parallel and cfg.block_size % tp:
        raise ValueError(f"sequence parallelism over tp = {tp} needs block_size ({cfg.block_size}) divisible "
                         f"by {tp}")
    if pp > 1 or chunks > 1:
        make_schedule(schedule, pp, microbatches, chunks)
        partition_layers(cfg.n_layer, pp * chunks)
        check_stage_with_pipeline(zero_stage, True)
    if cfg.dropout and (dp > 1 or pp > 1 or microbatches > 1):
        raise ValueError("dropout > 0 needs dp = pp = 1 and microbatches = 1: the masks of split batches "
                         "would differ from single-process training (tensor parallelism keeps them equal)")


def check_moe_layout(cfg, tp, pp, cp, sequence_parallel):
    """What a mixture-of-experts model composes with (expert_parallel.py): dp/ep, ZeRO-1/2/3,
    tp (the MoE layer whole on every tp rank) and pp (MoE layers inside stages, any schedule)."""
    E = cfg.n_expert
    if cp > 1:
        raise ValueError(f"a mixture-of-experts model (n_expert={E}) does not run with context parallelism "
                         f"yet: got cp={cp}; use cp=1, or n_expert=0")
    if tp > 1 and sequence_parallel:
        raise ValueError(f"a mixture-of-experts model (n_expert={E}) with sequence_parallel over tp={tp}: each "
                         f"tp rank would route only its T/tp tokens, so the capacity and the load-balancing "
                         f"loss would differ from one process; use sequence_parallel=False")


def parallelize(model, mesh, zero_stage=0, sequence_parallel=False, schedule="1f1b", microbatches=1,
                chunks=1, data_parallel="bucketed", bucket_cap_mb=25, first_bucket_cap_mb=1,
                check_finite=None, precision="fp32", scaler=None, context_parallel=None, deterministic=False):
    """The GPT ``model`` on this rank of ``mesh`` (a DeviceMesh), as one strategy of the one
    shape. ``data_parallel``: "bucketed" (DataParallel) or "naive" (DataParallelNaive),
    used when zero_stage = 0; ZeRO stages 1-3 replace it. ``precision``: "fp32" (the model's
    dtype), "bf16" or "fp16" (low-precision params and grads, fp32 masters: MixedPrecision,
    outermost; ``scaler``: fp16's GradScaler, default ``GradScaler()``). The precision's policy
    (pdist/engine/precision.py) goes to ``Local`` at once: the model is cast only after
    tensor parallelism has cut its fp32 shards, and DDP/ZeRO read ``has_late_grads`` when built.
    ``context_parallel``: "ring", "ring-zigzag" or "ulysses" with ``DeviceMesh(cp=)``
    (pdist/parallel/context/): DDP/ZeRO then span the dp x cp ranks.
    ``deterministic``: True (or a power-of-two granule count, or a ``Deterministic``): the same
    bits as one process on every layout it accepts (pdist/parallel/deterministic/)."""
    check_layout(model.config, mesh, zero_stage, sequence_parallel, schedule, microbatches, chunks,
                 data_parallel, precision)
    chunks = default_chunks(schedule, chunks)
    det = Deterministic.of(deterministic)
    check_hybrid(model.config, mesh, zero_stage, det is not None)
    if det is not None:                    # what the mode refuses, on every rank, before any collective
        check_deterministic(det, model.config, mesh.dp_world_size, mesh.tp_world_size, mesh.pp_world_size,
                            getattr(mesh, "cp_world_size", 1), getattr(mesh, "ep_world_size", 1), chunks,
                            microbatches, precision, sequence_parallel, context_parallel)
    pipelined = mesh.pp_world_size > 1 or chunks > 1
    check_context(model.config, mesh, context_parallel, precision, pipelined)
    dp_group = mesh.dp_cp_group if context_parallel else mesh.dp_group
    s = Local(model, 1 if pipelined else microbatches, policy=policy_for(precision), deterministic=det)
    if check_finite is not None:       # None: PDIST_CHECK_FINITE (default on)
        s.check_finite = bool(check_finite)
    if mesh.tp_world_size > 1:
        s = TensorParallel(s, mesh.tp_group, sequence_parallel=sequence_parallel)
    cp = context_parallel and install(model, mesh.cp_group, context_parallel)   # on this tp rank's heads
    cast_module(model, precision)          # after tensor parallelism built its (fp32) shards
    if pipelined:
        s = PipelineParallel(s, mesh.pp_group, schedule, microbatches, chunks)
    if getattr(model.config, "n_expert", 0) and (mesh.dp_world_size > 1 or zero_stage):
        s = ExpertParallel(s, mesh, zero_stage)   # experts over ep (E/ep per rank); ZeRO inside it: edp shards
    elif zero_stage and getattr(mesh, "dp_replicate_world_size", 1) > 1:     # hybrid: shard inside, replicate across
        shard = mesh.dp_shard_cp_group if context_parallel else mesh.dp_shard_group   # cp: shard over dp_shard x cp
        s = HSDP(s, zero_stage, shard, mesh.dp_replicate_group, dp_group=dp_group)
    elif zero_stage:               # ZeRO fills a meta model's shards itself; the rest materialize here
        s = ZeRO(s, zero_stage, dp_group)
    elif data_parallel == "naive" and dp_group.size > 1:
        s = DataParallelNaive(s, dp_group)
    elif dp_group.size > 1:
        s = DataParallel(s, dp_group, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)
    s.materialize()                # a meta model (GPT(cfg, seed, device="meta")): this rank's pieces only
    if cp:
        s = ContextParallel(s, mesh, cp)
    if low_dtype(precision) is not None:    # outermost: its step (the scaler's skip) wraps everything
        s = MixedPrecision(s, precision, scaler)
    s.mesh = mesh
    return s


__all__ = ["parallelize", "check_layout", "check_moe_layout"]
