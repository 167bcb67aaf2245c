"""pdist.memory: distinct-buffer byte counts and the tracemalloc peak (single process)."""
import numpy as np

from pdist import gpt, lesson, memory
from pdist.autograd import Tensor


def test_views_count_their_buffer_once():
    flat = np.zeros(1000)                       # 8000 B
    a, b = flat[:300].reshape(10, 30), flat[300:]
    other = np.zeros(10, dtype=np.float32)      # 40 B
    assert memory.unique_nbytes([a, b, flat, other, None]) == 8000 + 40
    assert memory.unique_nbytes([a]) == 8000    # a view counts the whole buffer it lives in


def test_model_state_bytes_of_a_plain_model_and_adamw():
    cfg = gpt.GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=8, dtype="float32")
    model = gpt.GPT(cfg, seed=0)
    psi = cfg.num_params()
    opt = lesson.make_adamw(model.parameters())
    before = memory.model_state_bytes(model, opt)
    assert before == {"params_bytes": 4 * psi, "grads_bytes": 0, "optim_bytes": 0}
    _, loss = model(np.zeros((2, 8), dtype=np.int64), np.ones((2, 8), dtype=np.int64))
    loss.backward()
    opt.step()
    assert memory.model_state_bytes(model, opt) == {"params_bytes": 4 * psi, "grads_bytes": 4 * psi,
                                                    "optim_bytes": 8 * psi}


def test_peak_sees_a_temporary_that_is_already_freed():
    memory.start_tracing(restart=True)
    keep = np.ones(1000)
    with memory.PeakMemory() as quiet:
        np.ones(10).sum()
    with memory.PeakMemory() as pk:
        t = np.ones(1_000_000)                  # 8 MB, freed before the block ends
        del t
    memory.stop_tracing()
    assert pk.peak_bytes >= 8_000_000 + keep.nbytes
    assert quiet.peak_bytes < 1_000_000


def test_memory_row_fields():
    t = Tensor(np.zeros(4), requires_grad=True)

    class M:
        def parameters(self):
            return [t]
    row = memory.memory_row(3, M(), None, peak_bytes=123)
    assert row == {"rank": 3, "params_bytes": 32, "grads_bytes": 0, "optim_bytes": 0, "peak_bytes": 123}
