"""Kernels: `cpu/`, the fused CPU decoder (C++, compiled on first use), and later Triton
kernels and GPU attention backends. GPU code is imported only when chosen, through
`shared.model.attention.get_attention_backend`."""
