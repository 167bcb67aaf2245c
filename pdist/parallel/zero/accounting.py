"""What a ZeRO rank holds, for pdist.measure.memory and the lessons: its live arrays, the
bytes its buffer pool keeps for reuse ("held"), and Ψ with and without the shards' padding."""


class Accounting:
    """Mixed into ZeRO (zero.py): reads ``self.units`` and ``self.pool`` only."""

    def state_arrays(self):
        """(param arrays, grad arrays) live on this rank, views included
        (pdist.measure.memory counts each underlying buffer once)."""
        params = [p.data for u in self.units for p in u.params] + [u.shard.data for u in self.units]
        grads = [p.grad for u in self.units for p in u.params] + \
                [a for u in self.units for a in (u.grad_flat, u.shard.grad)]
        return params, [g for g in grads if g is not None]

    def held_bytes(self):
        """Bytes this rank holds free for reuse (the buffer pool: gathered units and full
        gradients of the last step, host_memory.BufferPool): resident, not live; the RSS
        counts them, the formula does not."""
        return self.pool.held_bytes()

    @property
    def numel(self):
        """Ψ: the model's parameter count (no padding)."""
        return sum(u.numel for u in self.units)

    @property
    def numel_padded(self):
        """Σ_units Ψ_pad: the elements the flat buffers hold (= Ψ at stage 0)."""
        return sum(u.padded for u in self.units)
