"""Accelerator kernels: Triton kernels (tested on CPU with TRITON_INTERPRET=1) and GPU
attention backends. Nothing here is imported on the CPU path; backends are chosen by name
through `shared.model.attention.get_attention_backend`. Empty until the first kernel lands."""
