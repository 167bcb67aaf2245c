"""The executor's B and W: a zero-bubble schedule's split backward (Qi et al., 2024,
"Zero Bubble Pipeline Parallelism"), run by ``PipelineParallel`` for the instructions
BACKWARD_INPUT and BACKWARD_WEIGHT (schedules.py).

For a stage f_k with input x and weights W_k, micro-batch i:

    B (BACKWARD_INPUT):   dL_i/dx = (df_k/dx)^T dL_i/dy      sent at once to stage k-1
    W (BACKWARD_WEIGHT):  dL_i/dW_k = (df_k/dW_k)^T dL_i/dy   accumulated into W_k.grad

B is ``out.backward(g, defer_weights=True, inputs=[x])`` (pdist/engine/split_backward.py):
it frees what only B needed and keeps, per (micro-batch, chunk), a ``WeightGradients``
holding what W needs (each Linear's input and dL/dy); W is its ``run()``. B then W is bit
for bit the whole BACKWARD, so every schedule keeps the gradient sums of one process.
The precision keeper's per-micro-batch step (``after_backward``) follows W, when the
micro-batch's weight gradients are complete.

What B keeps for W (each ``WeightGradients``' ``nbytes``) is measured per step beside the
peak stash (stats.py: ``peak_held_w``, ``peak_held_w_bytes``).
"""
from pdist.engine.backend import xp


def backward_input(pipe, ins, g):
    """B of (mb, chunk): dL/dx now (sent by the SEND_GRAD that follows), W's part kept.
    ``g``: dL/d(the stage's output), from the next stage (None on the last)."""
    mb, c, k = ins.mb, ins.chunk, pipe._stage(ins)
    x, out = pipe._stash.pop((mb, c))                    # the activations B needs are freed by B
    inputs = (x,) if k > 0 else ()                       # stage 0's input is the token ids
    held = out.backward(g, defer_weights=True, inputs=inputs)
    if k > 0:
        pipe._grads[(mb, c)] = x.grad if x.grad is not None else xp.zeros_like(x.data)
    pipe._held_w[(mb, c)] = held


def backward_weight(pipe, ins):
    """W of (mb, chunk): the weight gradients B left, into .grad (hooks fire here)."""
    mb, c, k = ins.mb, ins.chunk, pipe._stage(ins)
    held = pipe._held_w.pop((mb, c), None)
    if held is None:
        raise RuntimeError(f"pipeline rank {pipe.pp_rank}: {ins} runs before the BACKWARD_INPUT of micro-batch "
                           f"{mb}, chunk {c}; the schedule must put each W after its B (check_schedule)")
    held.run()
    pipe._keeper.after_backward(k, mb)                    # bf16/fp16: this micro-batch's grads into fp32 sums


def check_all_weights_done(pipe):
    """At the end of the step: no B is left without its W (its gradients would be lost)."""
    if pipe._held_w:
        left = sorted(pipe._held_w)
        raise RuntimeError(f"pipeline rank {pipe.pp_rank}: the step ended with the weight gradients of "
                           f"(micro-batch, chunk) {left} not computed: the schedule needs a BACKWARD_WEIGHT "
                           "after every BACKWARD_INPUT")


__all__ = ["backward_input", "backward_weight", "check_all_weights_done"]
