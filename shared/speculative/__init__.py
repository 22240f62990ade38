"""Speculative decoding: draft trees, drafters and their verification rules."""
