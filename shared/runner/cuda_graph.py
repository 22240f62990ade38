"""CUDA graphs of decode steps: SGLang's `--cuda-graph-max-bs`, `--disable-cuda-graph` and
`--enable-torch-compile`, on CUDA devices only.

A decode step (every sequence one new token, causal) of at most max_bs sequences replays the
graph of the smallest capture size that holds it, captured on that size's first use. The batch
is padded to that size by repeating its last sequence: same token, position and cache slot, so
the copy writes the K/V the original writes, and its output is dropped. A graph reads fixed
input buffers and fixed attention metadata, which the backend (`static_decode`: the triton and
flashinfer backends) refills outside the graph before each replay; the torch backend's decode
gathers a context of changing length, so it runs without graphs. Every other step (prefill,
draft-tree verification, whose trees differ in size) runs eagerly. With torch_compile the
captured forward is torch.compile'd first, one static-shape graph per size, as SGLang does.

NEVER RUN ON A GPU YET. On CPU, `StaticStep.forward` (the forward a graph records) is tested
with the triton backend under Triton's interpreter; capture and replay are not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

Outputs = tuple[torch.Tensor, list[torch.Tensor]]  # hidden [bs, hidden], aux layers' [bs, hidden]


class StaticDecode(Protocol):
    meta: Any  # the attention metadata the model reads; its tensors stay where they are

    def update(self, spans: list[SequenceSpan]) -> None: ...


@runtime_checkable
class GraphBackend(Protocol):
    def static_decode(
        self, batch_size: int, max_blocks: int, block_size: int, device: torch.device
    ) -> StaticDecode: ...


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 below max_bs, and max_bs (as SGLang steps)."""
    return sorted({*(s for s in (1, 2, 4) if s < max_bs), *range(8, max_bs, 8), max_bs})


class StaticStep:
    """One capture size's fixed inputs and attention metadata, the forward over them, and
    once captured, its graph and the graph's output tensors."""

    def __init__(
        self,
        forward: Callable[..., Outputs],  # the model's forward, compiled or not
        kv_cache: KVCache,
        attention: StaticDecode,
        size: int,
        aux_layers: tuple[int, ...],
    ) -> None:
        device = kv_cache.storage.device
        self.run, self.kv_cache, self.attention = forward, kv_cache, attention
        self.aux_layers = aux_layers
        self.ids = torch.zeros(size, dtype=torch.long, device=device)  # [size]
        self.pos = torch.zeros(size, dtype=torch.long, device=device)  # [size]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Outputs | None = None

    def load(self, spans: list[SequenceSpan], ids: torch.Tensor, pos: torch.Tensor) -> None:
        """Fill the inputs with a decode batch of up to `size` rows, padded by its last."""
        n, pad = len(spans), len(self.ids) - len(spans)
        for buffer, values in ((self.ids, ids), (self.pos, pos)):
            buffer[:n].copy_(values)
            buffer[n:] = values[-1]
        self.attention.update(spans + spans[-1:] * pad)

    def forward(self) -> Outputs:
        meta = self.attention.meta
        return self.run(self.ids, self.pos, self.kv_cache.layers, meta, self.aux_layers)

    def capture(self, pool: Any) -> None:
        """Warm up on a side stream (kernel compilation, torch.compile), then record a graph.
        The inputs hold a real batch: warming up writes its K/V, as the replay does again."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = self.forward()

    def replay(self) -> Outputs:
        self.graph.replay()
        return self.outputs


class DecodeGraphs:
    """The decode steps' graphs of one model runner, by (capture size, aux layers)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        backend: GraphBackend,
        max_bs: int,
        max_blocks: int,
        torch_compile: bool,
    ) -> None:
        self.kv_cache, self.backend, self.max_blocks = kv_cache, backend, max_blocks
        self.sizes = capture_sizes(max_bs)
        self.forward = model.forward
        if torch_compile:
            from torch._dynamo import config as dynamo

            # one static-shape compilation per capture size, beyond dynamo's default limit
            dynamo.recompile_limit = max(dynamo.recompile_limit, 2 * len(self.sizes))
            self.forward = torch.compile(model.forward, mode="max-autotune-no-cudagraphs")
        self.steps: dict[tuple[int, tuple[int, ...]], StaticStep] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def run(
        self,
        spans: list[SequenceSpan],
        ids: torch.Tensor,
        pos: torch.Tensor,
        aux_layers: tuple[int, ...],
    ) -> Outputs | None:
        """The step's hidden states [n, hidden] and aux-layer outputs from its graph; None
        when it is not a decode step these graphs hold (the caller runs it eagerly)."""
        if not self.holds(spans):
            return None
        size = next(s for s in self.sizes if s >= len(spans))
        step = self.steps.get((size, aux_layers))
        if step is None:
            attention = self.backend.static_decode(
                size, self.max_blocks, self.kv_cache.block_size, self.kv_cache.storage.device
            )
            step = StaticStep(self.forward, self.kv_cache, attention, size, aux_layers)
            self.steps[(size, aux_layers)] = step
        step.load(spans, ids, pos)
        if step.graph is None:
            step.capture(self.pool)
        hidden, aux = step.replay()
        n = len(spans)
        # the graph's outputs are overwritten by its next replay: aux features are kept
        return hidden[:n], [a[:n].clone() for a in aux]

    def holds(self, spans: list[SequenceSpan]) -> bool:
        most = self.max_blocks * self.kv_cache.block_size
        return len(spans) <= self.sizes[-1] and all(
            s.num_new == 1 and s.mask is None and s.num_cached < most for s in spans
        )


def decode_graphs(
    model: LlamaForCausalLM,
    kv_cache: KVCache,
    max_model_len: int,
    max_bs: int,
    disable: bool,
    torch_compile: bool,
) -> DecodeGraphs | None:
    """The runner's decode graphs, or None (logged) where there are none: off, not CUDA,
    or a backend without fixed decode metadata."""
    backend = model.attention_backend
    if kv_cache.storage.device.type != "cuda":
        if torch_compile:
            log.warning("--enable-torch-compile is ignored on CPU (it compiles CUDA graphs)")
        return None
    if disable or not isinstance(backend, GraphBackend):
        if not disable:
            name = type(backend).__name__
            log.info("no CUDA graphs: %s has no fixed-buffer decode; decode runs eagerly", name)
        if torch_compile:
            log.warning("--enable-torch-compile has no effect without CUDA graphs")
        return None
    max_blocks = -(-max_model_len // kv_cache.block_size)
    return DecodeGraphs(model, kv_cache, backend, max_bs, max_blocks, torch_compile)
