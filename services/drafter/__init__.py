"""Drafter service: any speculative algorithm, with per-request draft state."""
