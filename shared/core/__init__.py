"""Core types every layer above shares: a request's `Sequence` and the `DraftTree` that
drafters propose and the runner verifies. Imports nothing of ours but sampling params."""
