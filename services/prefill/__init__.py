"""Prefill service: computes prompts, samples first tokens, stores K/V in the transport."""
