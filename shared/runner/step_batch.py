"""One engine step's sequences as the rows of one forward.

A sequence adds its next `num` tokens (a prefill chunk, or its last token when decoding)
or, with a draft tree, the tree's nodes (root = its last token), each node at its own
depth and seeing only its ancestors. A sequence whose tokens are all computed after the
step samples at its last row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from specmesh.shared.core.sequence import Sequence
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.runner.images import step_embeds


@dataclass
class StepBatch:
    spans: list[SequenceSpan] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # the last row of each that samples
    sampled: list[Sequence] = field(default_factory=list)  # the sequences sampling, in order
    tree_rows: list[int] = field(default_factory=list)  # every draft tree node's row
    first_row: dict[Sequence, int] = field(default_factory=dict)
    image_rows: list[int] = field(default_factory=list)  # rows whose embedding is an image's
    image_features: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        model: LlamaForCausalLM,
        batch: list[tuple[Sequence, int]],
        trees: dict[Sequence, DraftTree],
    ) -> StepBatch:
        rows = cls()
        for seq, num in batch:
            rows.first_row[seq] = len(rows.input_ids)
            tree = trees.get(seq)
            if tree is not None:
                rows.add_tree(seq, tree)
            else:
                rows.add_tokens(model, seq, num)
        return rows

    def add_tree(self, seq: Sequence, tree: DraftTree) -> None:
        start, first = seq.num_computed_tokens, len(self.input_ids)
        self.spans.append(SequenceSpan(seq.block_table, start, len(tree), tree.ancestor_mask()))
        self.tree_rows += range(first, first + len(tree))
        self.input_ids += tree.tokens
        self.positions += [start + depth for depth in tree.depths()]

    def add_tokens(self, model: LlamaForCausalLM, seq: Sequence, num: int) -> None:
        start = seq.num_computed_tokens
        self.spans.append(SequenceSpan(seq.block_table, start, num))
        if (images := step_embeds(model, seq, start, num, len(self.input_ids))) is not None:
            self.image_rows += images[0]
            self.image_features.append(images[1])
        self.input_ids += seq.token_ids[start : start + num]
        self.positions += range(start, start + num)
        if start + num == len(seq):
            self.sample_rows.append(len(self.input_ids) - 1)
            self.sampled.append(seq)

    def embeds(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, vectors) replacing those rows' token embeddings, if any."""
        if not self.image_rows:
            return None
        rows = torch.tensor(self.image_rows, dtype=torch.long, device=device)
        return rows, torch.cat(self.image_features)
