"""Decode service: the target with a paged KV cache, continuous batching and verification."""
