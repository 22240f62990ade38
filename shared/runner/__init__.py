"""`ModelRunner`: one forward step of a model over the paged KV cache, then sampling.
Below the engine and the drafters (a STANDALONE drafter runs its own)."""
