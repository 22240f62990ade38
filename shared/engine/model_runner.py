"""Runs one engine step on the model: builds the flat batch, forwards, samples."""

from __future__ import annotations

import torch

from shared.engine.sequence import Sequence
from shared.kvcache.kv_cache import KVCache
from shared.model.attention import SequenceSpan
from shared.model.llama import LlamaForCausalLM
from shared.sampling.sampler import SampleOutput, Sampler
from shared.speculative.tree import DraftTree


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.embed_tokens.weight.device
        self.sampler = Sampler()

    @torch.inference_mode()
    def forward(
        self,
        spans: list[SequenceSpan],
        input_ids: list[int],
        positions: list[int],
        logit_rows: list[int],
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward new tokens of several sequences over their cached prefixes.

        Returns logits at `logit_rows` and the aux-layer hidden states of all rows."""
        meta = self.model.layers[0].self_attn.backend.prepare(
            spans, self.kv_cache.block_size, self.device
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden, aux = self.model(ids, pos, self.kv_cache.layers, meta, aux_layers)
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]), aux

    def step(
        self, batch: list[tuple[Sequence, int]], trees: dict[Sequence, DraftTree]
    ) -> tuple[list[Sequence], SampleOutput, dict[Sequence, torch.Tensor]]:
        """Compute `num` more tokens of each sequence; sample for those that reach their end.
        A sequence with a draft tree instead forwards the tree (root = its last token).

        Returns the sequences that got a sampled token, those tokens, and the logits at
        every node of each tree."""
        spans, input_ids, positions, sample_rows, tree_rows = [], [], [], [], []
        sampled: list[Sequence] = []
        for seq, num in batch:
            start = seq.num_computed_tokens
            tree = trees.get(seq)
            if tree is not None:  # every node at its own depth, seeing only its ancestors
                spans.append(SequenceSpan(seq.block_table, start, len(tree), tree.ancestor_mask()))
                tree_rows += range(len(input_ids), len(input_ids) + len(tree))
                input_ids += tree.tokens
                positions += [start + depth for depth in tree.depths()]
                continue
            spans.append(SequenceSpan(seq.block_table, start, num))
            input_ids += seq.token_ids[start : start + num]
            positions += range(start, start + num)
            if start + num == len(seq):
                sample_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        logits, _ = self.forward(spans, input_ids, positions, sample_rows + tree_rows)
        tree_logits, row = {}, len(sample_rows)
        for seq, tree in trees.items():
            tree_logits[seq] = logits[row : row + len(tree)]
            row += len(tree)
        out = self.sampler.sample(
            logits[: len(sample_rows)],
            [s.params for s in sampled],
            [s.prompt_ids for s in sampled],
            [s.output_ids for s in sampled],
            [s.generator for s in sampled],
        )
        return sampled, out, tree_logits
