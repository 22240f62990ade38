"""Runs one engine step on the model: builds the flat batch, forwards, samples."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from specmesh.shared.core.sequence import Sequence
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.kvcache.kv_cache import KVCache, TreeStates
from specmesh.shared.model.attention import SequenceSpan, TorchAttention
from specmesh.shared.model.fused import FusedDecoder
from specmesh.shared.model.gated_deltanet import LinearMetadata
from specmesh.shared.model.layers import pack_linears
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.runner.cuda_graph import DecodeGraphs
from specmesh.shared.runner.logits import sampled_logits
from specmesh.shared.runner.step_batch import StepBatch
from specmesh.shared.sampling.sampler import SampleOutput, Sampler, position_generator


@dataclass
class StepOutput:
    sampled: list[Sequence]  # sequences that got one sampled token
    samples: SampleOutput  # their tokens
    tree_logits: dict[Sequence, torch.Tensor]  # logits at every node of each draft tree
    features: dict[Sequence, torch.Tensor]  # per sequence, features of its input rows
    # hybrid models: per draft tree, its nodes' linear-attention states (written once one
    # path is accepted)
    node_states: dict[Sequence, TreeStates] = field(default_factory=dict)


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
        # Steps go through the fused C++ decoder where it applies, the rest through the
        # model's torch path. The decoder stands in for the torch attention backend only:
        # another backend, once chosen, runs every step.
        self.fused = None
        if isinstance(model.attention_backend, TorchAttention):
            self.fused = FusedDecoder.build(model, kv_cache.layers)
        self.graphs = graphs if model.config.linear is None else None  # graphs hold no states
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
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        linear: LinearMetadata | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward new tokens of several sequences over their cached prefixes. `embeds`:
        (rows, vectors) replacing those rows' token embeddings (image features).

        `linear`: a hybrid model's metadata for its linear-attention layers (built here when
        not given); the states of chain rows that their blocks keep are written once the
        forward succeeded, those of draft trees are left in `linear.kept` for verification.

        Returns logits at `logit_rows` and the aux-layer hidden states of all rows."""
        block_size = self.kv_cache.block_size
        plain = embeds is None  # only the model's torch path takes embeddings in
        if plain and self.fused is not None:
            out, _, aux = self.fused.forward(
                input_ids, positions, spans, block_size, logit_rows, aux_layers
            )
            # logits already where the fused call holds the LM head
            return (out if self.fused.has_lm_head else self.model.compute_logits(out)), aux
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        out_rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        out = None
        if plain and self.graphs is not None:
            out = self.graphs.run(spans, ids, pos, aux_layers)  # None: not a decode step
        if out is None:
            meta = self.model.attention_backend.prepare(spans, block_size, self.device)
            if linear is None and self.model.config.linear is not None:
                linear = LinearMetadata.build(spans, block_size, self.device)
            out = self.model(ids, pos, self.kv_cache.layers, meta, aux_layers, embeds, linear)
            if linear is not None and linear.chain_slots:
                rows, blocks = zip(*linear.chain_slots, strict=True)
                self.kv_cache.write_states(linear.kept, list(rows), list(blocks))
        hidden, aux = out
        return self.model.compute_logits(hidden[out_rows]), aux

    def verify_seconds(
        self, block_table: list[int], context: int, most: int, rounds: int = 5
    ) -> list[float]:
        """Seconds of a forward of one sequence's root and k drafts (a chain) over `context`
        cached tokens, k = 0..most: the cost curve draft budgets follow. Each round times
        every k once, so a busy moment (other services starting) slows a few samples of
        each k rather than all of one; each k keeps its best."""
        best = [float("inf")] * (most + 1)
        for _ in range(rounds):
            for k in range(most + 1):
                n = k + 1
                span = SequenceSpan(block_table, context, n)
                start = time.perf_counter()
                self.forward([span], [0] * n, list(range(context, context + n)), list(range(n)))
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                best[k] = min(best[k], time.perf_counter() - start)
        # Fewer tokens never cost more: a sample slowed by noise takes the cost of a larger k.
        for k in range(most - 1, -1, -1):
            best[k] = min(best[k], best[k + 1])
        return best

    @torch.inference_mode()
    def step(
        self, batch: list[tuple[Sequence, int]], trees: dict[Sequence, DraftTree]
    ) -> StepOutput:
        """Compute `num` more tokens of each sequence; sample for those that reach their end.
        A sequence with a draft tree instead forwards the tree (root = its last token)."""
        rows = StepBatch.of(self.model, batch, trees)
        linear = None
        if self.model.config.linear is not None:
            linear = LinearMetadata.build(rows.spans, self.kv_cache.block_size, self.device)
        logits, aux = self.forward(
            rows.spans,
            rows.input_ids,
            rows.positions,
            rows.sample_rows + rows.tree_rows,
            self.feature_layers,
            rows.embeds(self.device),
            linear,
        )
        tree_logits, row = {}, len(rows.sample_rows)
        for seq, tree in trees.items():
            tree_logits[seq] = logits[row : row + len(tree)]
            row += len(tree)
        return StepOutput(
            rows.sampled,
            self._sample(logits[: len(rows.sample_rows)], rows.sampled),
            tree_logits,
            self._features(aux, batch, trees, rows.first_row),
            _node_states(batch, linear),
        )

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence]) -> SampleOutput:
        return self.sampler.sample(
            sampled_logits(logits, sampled, self.eos_token_ids),
            [s.params for s in sampled],
            [s.prompt_ids for s in sampled],
            [s.output_ids for s in sampled],
            # A sequence samples once all its tokens are computed: the next is at len(s).
            [position_generator(s.params.seed, len(s), self.device) for s in sampled],
        )

    def _features(
        self,
        aux: list[torch.Tensor],
        batch: list[tuple[Sequence, int]],
        trees: dict[Sequence, DraftTree],
        first_row: dict[Sequence, int],
    ) -> dict[Sequence, torch.Tensor]:
        """Per sequence, the target features of its rows (what EAGLE drafters read)."""
        if not self.feature_layers:
            return {}
        # EAGLE reads the final normed hidden state; EAGLE-3 several layers side by side.
        rows = self.model.norm(aux[0]) if self.feature_normed else torch.cat(aux, dim=-1)
        features = {}
        for seq, num in batch:
            n = len(trees[seq]) if seq in trees else num
            features[seq] = rows[first_row[seq] : first_row[seq] + n]
        return features


def _node_states(
    batch: list[tuple[Sequence, int]], linear: LinearMetadata | None
) -> dict[Sequence, TreeStates]:
    """Hybrid models: per draft tree, its nodes' linear-attention states."""
    if linear is None:
        return {}
    return {
        seq: TreeStates(linear.kept, first)
        for (seq, _), first in zip(batch, linear.tree_first_kept, strict=False)
        if first is not None
    }
