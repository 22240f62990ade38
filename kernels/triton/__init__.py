"""Triton kernels for the GPU path (the `gpu` extra installs Triton), one concept a module:

- `attention`: causal / draft-tree attention over the paged KV cache, GQA, prefill chunks,
  verification and decode in one launch (reference: `shared.model.attention.TorchAttention`);
- `accept_greedy`, `accept_sampling`: a batch of draft trees accepted on the device
  (references: `shared.speculative.accept`);
- `kv_blocks`: paged cache blocks to and from one contiguous transport buffer (reference:
  `KVExchange.export` / `load`);
- `kv_move`: the accepted path's K/V moved to the positions it now occupies (reference:
  `KVCache.copy_tokens`, as `Speculator.verify` calls it).

The modules import Triton at their top, so only what chooses them imports them (the
`--attention-backend triton` backend, when chosen; the check): CPU use never needs Triton.
`python -m specmesh.kernels.check` holds every kernel to its reference; without a GPU it runs them
under Triton's interpreter (`TRITON_INTERPRET=1`), which must be set before these modules are
imported (Triton reads it when a kernel is defined).
"""
