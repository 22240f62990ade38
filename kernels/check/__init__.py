"""`python -m specmesh.kernels.check`: every Triton kernel (`kernels.triton`) against its reference,
printed as a table (kernel, shape, max abs error or exact match, pass). A module here per
kernel module holds its cases and reference; `suite` runs them all, `result` records and
prints the outcomes, and `python -m specmesh.kernels.check.compile` compiles the kernels for a GPU
without one.

The references are the torch and Python paths the engine runs today, called as they are
(`TorchAttention`, `shared.speculative.accept`, `KVExchange`, `KVCache.copy_tokens`), so this
package sits above `shared` while `kernels.triton` imports nothing of ours. On a GPU the
kernels run natively on larger shapes (fp32 and bf16); without one they run under Triton's
interpreter on tiny shapes, which is what `tests/test_kernels.py` does.
"""
