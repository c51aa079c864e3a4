"""The model's attention contract.

The model calls attention as `fn(q_TNH, k_SNH, v_SNH) -> o_TNH` and knows nothing of parallelism:
the runtime hands it callables bound to one step (zellige.runtime.attention_fn for self- or joint
attention, cross_attention_fn for cross-attention). Without them the model attends each local
sequence whole with the runtime's `local_attention` (runtime/local.py), on the same engine.
"""

from __future__ import annotations

from zellige.runtime.local import AttentionFn, local_attention

__all__ = ["AttentionFn", "local_attention"]
