"""The drafters' committed-context buffers (drafter_svc.kv), numpy and MLX alike."""

import mlx.core as mx
import numpy as np

from drafter_svc.kv import KV_STEP, EntryBuffers


def test_entry_buffers_grow_a_step_at_a_time_and_keep_what_was_committed():
    for kind in ("numpy", "mlx"):
        buffers = EntryBuffers()
        total = []
        for n in (3, KV_STEP - 3, 5):  # the third append outgrows the first step
            block = np.arange(2 * n * 4, dtype=np.float32).reshape(2, n, 4) + len(total)
            kv = block if kind == "numpy" else mx.array(block)
            buffers.append([(kv, kv * 2)])
            total.append(block)
        keys, values = buffers.committed()[0]
        want = np.concatenate(total, axis=1)
        assert buffers.entries == want.shape[1] and buffers.capacity == 2 * KV_STEP
        assert np.array_equal(np.array(keys), want) and np.array_equal(np.array(values), 2 * want)
        assert isinstance(keys, np.ndarray) == (kind == "numpy")
