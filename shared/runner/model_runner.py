"""Runs one engine step on the model: builds the flat batch, forwards, samples."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shared.core.sequence import Sequence
from shared.core.tree import DraftTree
from shared.kvcache.kv_cache import KVCache
from shared.model.attention import SequenceSpan, TorchAttention
from shared.model.fused import FUSED_MAX_ROWS, FusedDecoder
from shared.model.llama import LlamaForCausalLM, pack_linears
from shared.runner.cuda_graph import DecodeGraphs
from shared.runner.logits import sampled_logits
from shared.sampling.sampler import SampleOutput, Sampler, position_generator


@dataclass
class StepOutput:
    sampled: list[Sequence]  # sequences that got one sampled token
    samples: SampleOutput  # their tokens
    tree_logits: dict[Sequence, torch.Tensor]  # logits at every node of each draft tree
    features: dict[Sequence, torch.Tensor]  # per sequence, features of its input rows


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        eos_token_ids: frozenset[int] = frozenset(),
        graphs: DecodeGraphs | None = None,
    ) -> None:
        """`eos_token_ids`: what a request's min_tokens keeps from being sampled too early.
        `graphs`: CUDA graphs that decode steps replay (shared.runner.cuda_graph)."""
        pack_linears(model)  # a runner only infers
        self.model = model
        self.kv_cache = kv_cache
        self.eos_token_ids = eos_token_ids
        # Few rows go through the fused C++ decoder where it applies; the rest (prefill)
        # through the model's torch path. The decoder stands in for the torch attention
        # backend only: another backend, once chosen, runs every step.
        self.fused = None
        if isinstance(model.layers[0].self_attn.backend, TorchAttention):
            self.fused = FusedDecoder.build(model, kv_cache.layers)
        self.graphs = graphs
        self.device = model.embed_tokens.weight.device
        self.sampler = Sampler()
        # Target features an EAGLE drafter needs: the outputs of these layers, and whether
        # the (single) one is taken after the final norm.
        self.feature_layers: tuple[int, ...] = ()
        self.feature_normed = False

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
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        block_size = self.kv_cache.block_size
        out = None
        if self.fused is not None and len(input_ids) <= FUSED_MAX_ROWS:
            out = self.fused.forward(ids, pos, spans, block_size, aux_layers)
        elif self.graphs is not None:
            out = self.graphs.run(spans, ids, pos, aux_layers)  # None: not a decode step
        if out is None:
            meta = self.model.layers[0].self_attn.backend.prepare(spans, block_size, self.device)
            out = self.model(ids, pos, self.kv_cache.layers, meta, aux_layers)
        hidden, aux = out
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]), aux

    def verify_seconds(self, block_table: list[int], context: int, most: int) -> list[float]:
        """Seconds of a forward of one sequence's root and k drafts (a chain) over `context`
        cached tokens, k = 0..most (best of 3): the cost curve draft budgets follow."""
        seconds = []
        for k in range(most + 1):
            n = k + 1
            span = SequenceSpan(block_table, context, n)
            args = ([span], [0] * n, list(range(context, context + n)), list(range(n)))
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                self.forward(*args)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - start)
            # more tokens never cost less: a noisy sample must not make them look cheaper
            seconds.append(max([best, *seconds[-1:]]))
        return seconds

    @torch.inference_mode()
    def step(
        self, batch: list[tuple[Sequence, int]], trees: dict[Sequence, DraftTree]
    ) -> StepOutput:
        """Compute `num` more tokens of each sequence; sample for those that reach their end.
        A sequence with a draft tree instead forwards the tree (root = its last token)."""
        spans, input_ids, positions, sample_rows, tree_rows = [], [], [], [], []
        sampled: list[Sequence] = []
        first_row: dict[Sequence, int] = {}
        for seq, num in batch:
            start = seq.num_computed_tokens
            first_row[seq] = len(input_ids)
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
        logits, aux = self.forward(
            spans, input_ids, positions, sample_rows + tree_rows, self.feature_layers
        )
        tree_logits, row = {}, len(sample_rows)
        for seq, tree in trees.items():
            tree_logits[seq] = logits[row : row + len(tree)]
            row += len(tree)
        features = {}
        if self.feature_layers:
            # EAGLE reads the final normed hidden state; EAGLE-3 several layers side by side.
            rows = self.model.norm(aux[0]) if self.feature_normed else torch.cat(aux, dim=-1)
            for seq, num in batch:
                n = len(trees[seq]) if seq in trees else num
                features[seq] = rows[first_row[seq] : first_row[seq] + n]
        samples = self.sampler.sample(
            sampled_logits(logits[: len(sample_rows)], sampled, self.eos_token_ids),
            [s.params for s in sampled],
            [s.prompt_ids for s in sampled],
            [s.output_ids for s in sampled],
            # A sequence samples once all its tokens are computed: the next is at len(s).
            [position_generator(s.params.seed, len(s), self.device) for s in sampled],
        )
        return StepOutput(sampled, samples, tree_logits, features)
