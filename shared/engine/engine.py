"""The in-process engine: requests in, tokens out, one scheduler step at a time."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from specmesh.shared.config import (
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    device_option,
    dtype_option,
    model_option,
    option,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from specmesh.shared.core.images import PromptImage
from specmesh.shared.core.sequence import RemotePrefix, Sequence, SequenceStatus
from specmesh.shared.core.spec_stats import SpecStats
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.engine.scheduler import SCHEDULE_POLICIES, Scheduler
from specmesh.shared.engine.speculator import PendingDrafts, Speculator, StepCosts
from specmesh.shared.kvcache.block_manager import BlockManager
from specmesh.shared.kvcache.exchange import KVExchange, feature_tag
from specmesh.shared.kvcache.kv_cache import KVCache, blocks_for_mem_fraction
from specmesh.shared.model.attention import ATTENTION_BACKENDS
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.loader import load_model
from specmesh.shared.runner.cuda_graph import decode_graphs
from specmesh.shared.runner.images import place_images
from specmesh.shared.runner.model_runner import ModelRunner
from specmesh.shared.sampling.grammar import GrammarCompiler
from specmesh.shared.sampling.grammar_worker import COMPILE_TIMEOUT_S
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.drafter import Drafter
from specmesh.shared.speculative.factory import make_drafter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; each field is also a command-line option (see shared.config)."""

    model: str = model_option()
    device: str | None = device_option()
    dtype: str | None = dtype_option()
    block_size: int = option(16, "tokens per KV-cache block", aliases=("--page-size",))
    kv_cache_gb: float = option(
        1.0, "memory for the KV cache, GiB (on CUDA, --mem-fraction-static replaces it)"
    )
    mem_fraction_static: float | None = option(
        None,
        "CUDA only, as SGLang: the share of the device memory free at start that the weights "
        "and KV cache take together; the KV cache gets what the weights leave (on CPU "
        "--kv-cache-gb sizes it)",
    )
    kv_cache_dtype: str = option(
        "auto",
        "K/V storage dtype: auto (the model's), bf16, float16, fp8_e4m3, fp8_e5m2 (fp8 with "
        "scale 1.0, saturating); attention reads it back in the model's dtype",
        choices=KV_CACHE_DTYPES,
    )
    quantization: str | None = option(
        None,
        "weight-only, as SGLang's where it has the name: gguf multiplies the GGUF's blocks "
        "(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K, BF16) as the file holds them; awq, gptq an "
        "int4 checkpoint's groups (read from its config.json when unset); int8, int4 quantize "
        "a full-precision checkpoint at load (per 32 weights: symmetric int8; asymmetric "
        "int4, the LM head int8); bf16 rounds each weight to bf16 (half fp32's bytes, "
        "widened to fp32 in registers); all on CPU in fp32. fp8: e4m3 weights, per-row "
        "scales, CUDA only (default: full precision)",
        choices=QUANTIZATIONS,
    )
    max_num_seqs: int = option(
        64, "most sequences running at once", aliases=("--max-running-requests",)
    )
    max_num_batched_tokens: int = option(
        512,
        "token budget of one step (chunked prefill); a prompt chunk's attention over its "
        "cached context counts too, so late chunks of a long prompt are smaller",
        aliases=("--chunked-prefill-size",),
    )
    schedule_policy: str = option(
        "fair",
        "how a step's token budget goes to prompts: fair (shared evenly, so short prompts "
        "pass long ones, and a step that finishes a prompt stays short), fcfs (the oldest "
        "first) or lpm (fcfs, the longest cached prefix first)",
        choices=SCHEDULE_POLICIES,
    )
    max_model_len: int | None = option(
        None,
        "context limit (default: the model's, capped by the cache)",
        aliases=("--context-length",),
    )
    attention_backend: str = option("torch", "attention implementation", choices=ATTENTION_BACKENDS)
    cuda_graph_max_bs: int | None = option(
        None,
        "as SGLang: the largest decode batch replayed from a CUDA graph (default: "
        "--max-num-seqs); CUDA with the triton or flashinfer backend; no effect on CPU",
    )
    disable_cuda_graph: bool = option(
        False, "as SGLang: decode without CUDA graphs (no effect on CPU, which has none)"
    )
    enable_torch_compile: bool = option(
        False,
        "as SGLang: torch.compile the forward that CUDA graphs capture; ignored on CPU "
        "(logged), where the packed matmuls do not compile",
    )
    random_seed: int | None = option(
        None, "seed for sampling the requests that bring no seed of their own (default: random)"
    )
    grammar_compile_timeout: float = option(
        COMPILE_TIMEOUT_S, "seconds a grammar may take to compile before its request gets a 400"
    )


@dataclass
class TokenOutput:
    """What one step produced for one request."""

    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int = 0
    num_reused_tokens: int = 0
    spec: SpecStats | None = None  # the request's speculation totals, on its last token


@dataclass
class FirstToken:
    """A request's first token, sampled where its prompt was prefilled."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class EngineStats:
    steps: int = 0
    computed_tokens: int = 0  # tokens forwarded through the model (prefill and decode)
    generated_tokens: int = 0
    step_seconds: float = 0.0
    draft_wait_seconds: float = 0.0  # waiting for drafts (a drafter in another process)


def _free_cuda_memory(device: torch.device) -> int:
    """Bytes free on a CUDA device, counting what torch's allocator caches but no tensor
    holds as free (what --mem-fraction-static divides)."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _kv_cache(
    cfg: EngineConfig,
    mcfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    free_at_start: int | None,
) -> KVCache:
    """The engine's KV cache: sized by --mem-fraction-static where `free_at_start` (CUDA bytes
    free before the weights were loaded) is given, else by --kv-cache-gb."""
    if free_at_start is None:
        if cfg.mem_fraction_static is not None:
            log.info("--mem-fraction-static applies to CUDA; --kv-cache-gb sizes this KV cache")
        cache = KVCache.for_memory(mcfg, cfg.kv_cache_gb, cfg.block_size, device, dtype)
    else:
        context = min(cfg.max_model_len or 1, mcfg.max_position_embeddings)
        blocks = blocks_for_mem_fraction(
            cfg.mem_fraction_static,
            free_at_start,
            _free_cuda_memory(device),
            KVCache.block_bytes(mcfg, cfg.block_size, dtype),
            min_blocks=-(-context // cfg.block_size),  # one sequence of the asked context
        )
        cache = KVCache(mcfg, blocks, cfg.block_size, device, dtype)
    gib = cache.num_blocks * KVCache.block_bytes(mcfg, cfg.block_size, dtype) / 2**30
    log.info(
        "KV cache: %d blocks of %d tokens, %.2f GiB of %s",
        cache.num_blocks,
        cfg.block_size,
        gib,
        str(dtype).removeprefix("torch."),
    )
    return cache


def _generation_eos(model_dir: Path) -> set[int]:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


class LLMEngine:
    def __init__(
        self,
        cfg: EngineConfig,
        spec: SpeculativeConfig | None = None,
        drafter: Drafter | None = None,
        overlap: bool = False,
    ) -> None:
        """`drafter` replaces the one `spec` names (a drafter service's client). With
        `overlap`, sequences alternate between two batches, and one batch's drafts are
        made while the other is verified (useful when the drafter is another process)."""
        self.cfg = cfg
        if cfg.random_seed is not None:  # unseeded requests draw from torch's default generator
            torch.manual_seed(cfg.random_seed)
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, dtype, device)
        if cfg.model is None:
            raise ValueError("EngineConfig.model must name a model directory or .gguf file")
        by_fraction = cfg.mem_fraction_static is not None and device.type == "cuda"
        free_at_start = _free_cuda_memory(device) if by_fraction else None
        if kv_dtype != dtype and cfg.attention_backend != "torch":
            raise ValueError(
                f"--kv-cache-dtype {cfg.kv_cache_dtype} needs --attention-backend torch: the "
                f"{cfg.attention_backend} backend reads K/V in the model's dtype"
            )
        self.model = load_model(cfg.model, device, dtype, cfg.attention_backend, cfg.quantization)
        mcfg = self.model.config
        self.kv_cache = _kv_cache(cfg, mcfg, device, kv_dtype, free_at_start)
        self.max_model_len = min(
            cfg.max_model_len or mcfg.max_position_embeddings,
            mcfg.max_position_embeddings,
            self.kv_cache.num_blocks * cfg.block_size,
        )
        self.eos_token_ids = set(mcfg.eos_token_ids) | _generation_eos(Path(cfg.model))
        self._grammars: GrammarCompiler | None = None  # built by the first constrained request
        self.block_manager = BlockManager(self.kv_cache.num_blocks, cfg.block_size)
        self.scheduler = Scheduler(
            self.block_manager,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.schedule_policy,
            mcfg.attention_tokens,
        )
        eos = frozenset(self.eos_token_ids)
        max_bs = cfg.cuda_graph_max_bs or cfg.max_num_seqs
        graphs = decode_graphs(
            self.model,
            self.kv_cache,
            self.max_model_len,
            max_bs,
            cfg.disable_cuda_graph,
            cfg.enable_torch_compile,
        )
        self.runner = ModelRunner(self.model, self.kv_cache, eos, graphs)
        self.speculator: Speculator | None = None
        # Called with (sequence, target features of the rows it computed this step, the first
        # row's position) once `runner.feature_layers` is set: the EAGLE speculator, prefill's
        # hand-over to decode, training-data capture.
        self.feature_listeners: list[Callable[[Sequence, torch.Tensor, int], None]] = []
        # Called with each step's seconds (a service's step-time metric).
        self.step_listeners: list[Callable[[float], None]] = []
        # Called with a sequence about to finish, its blocks still held (prefill's hand-over).
        self.finish_listeners: list[Callable[[Sequence], None]] = []
        if spec is not None and spec.enabled:
            spec = spec.resolved(cfg.model)
            drafter = drafter or make_drafter(spec, self.model)
            self.runner.feature_layers, self.runner.feature_normed = drafter.target_features
            self.speculator = Speculator(spec, drafter, self.kv_cache, self.block_manager, eos)
            self.feature_listeners.append(self.speculator.add_features)
            if spec.speculative_adaptive:
                self.speculator.costs = StepCosts(self._verify_seconds(self.speculator.max_drafts))
        self.sequences: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.failed: dict[str, Exception] = {}  # requests a step failed alone (see _run)
        self.kv_exchange: KVExchange | None = None  # set where prompts arrive prefilled
        self.overlap = overlap and self.speculator is not None
        self._next_lane = 0
        self._lane = 0
        self._pending: dict[int, tuple[list[tuple[Sequence, int]], PendingDrafts]] = {}

    def _verify_seconds(self, most: int, context: int = 256) -> list[float]:
        """The verify cost curve (ModelRunner.verify_seconds) over scratch blocks."""
        context = max(0, min(context, self.max_model_len - most - 1))
        probe = Sequence("verify-cost-probe", [0] * (context + most + 1), SamplingParams())
        self.block_manager.allocate(probe)
        try:
            return self.runner.verify_seconds(probe.block_table, context, most)
        finally:
            self.block_manager.free(probe)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError with a user-facing message if the request cannot run."""
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the maximum context length of {self.max_model_len} tokens"
            )
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if any(not 0 <= token < vocab for token in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if params.top_k > vocab:
            raise ValueError(f"top_k must be at most the vocabulary size ({vocab})")
        if params.grammar is not None:
            self.grammars.compile(params.grammar)
        if params.grammar_prefix > len(prompt_ids):
            raise ValueError("grammar_prefix is longer than the prompt")

    def start_grammar_compiler(self) -> None:
        """Start compiling grammars' process now (services do, at start-up) where this
        model can constrain output; where it cannot, the first constrained request is
        refused and says why."""
        with contextlib.suppress(ValueError):
            self.grammars.start()

    @property
    def grammars(self) -> GrammarCompiler:
        """The model's grammar compiler (its vocabulary, the grammars compiled for it)."""
        if self._grammars is None:
            model = Path(self.cfg.model)
            tokenizer = (model if model.is_dir() else model.parent) / "tokenizer.json"
            vocab, eos = self.model.config.vocab_size, sorted(self.eos_token_ids)
            self._grammars = GrammarCompiler(
                tokenizer, vocab, eos, self.cfg.grammar_compile_timeout
            )
        return self._grammars

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        remote_kv: RemotePrefix | None = None,
        first: FirstToken | None = None,
        images: list[PromptImage] | None = None,
    ) -> list[TokenOutput]:
        """Queue a request. `remote_kv`: its prompt's K/V (or a prefix of it) waits in the
        KV transport. `first`: its first token was sampled already (returned as output).
        `images`: the prompt's images, in the order of its image tokens."""
        self.check_request(prompt_ids, params)
        placed = place_images(self.model, prompt_ids, images) if images else None
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already running")
        if remote_kv is not None and self.kv_exchange is None:
            raise ValueError("this engine has no KV transport to load a prefilled prompt from")
        seq = Sequence(request_id, list(prompt_ids), params)
        seq.remote_kv, seq.lane = remote_kv, self._next_lane
        seq.images = placed
        if params.grammar is not None:
            seq.grammar = self.grammars.matcher(params.grammar)
            for token in prompt_ids[len(prompt_ids) - params.grammar_prefix :]:
                seq.grammar.accept(token)
        self._next_lane ^= self.overlap
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        outputs = []
        if first is not None:
            outputs = self._emit(seq, [first.token_id], first.logprob, first.top_logprobs)
        if self.speculator and seq.status is not SequenceStatus.FINISHED:
            self.speculator.open(seq)
        return outputs

    def abort(self, request_id: str) -> bool:
        seq = self.sequences.get(request_id)
        if seq is None:
            return False
        self._finish(seq)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            return "stop"
        if seq.grammar is not None and seq.grammar.finished:  # nothing may follow
            return "stop"
        if len(seq) - seq.num_prompt_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _schedule(self, lane: int | None = None) -> list[tuple[Sequence, int]]:
        """The scheduler's batch, with K/V prefilled elsewhere loaded instead of computed."""
        batch = self.scheduler.schedule(lane)
        for i, (seq, num) in enumerate(batch):
            remote, seq.remote_kv = seq.remote_kv, None  # a recompute after preemption computes
            if remote is None:
                continue
            self._load_features(seq, remote)
            if remote.num_tokens <= seq.num_computed_tokens:
                continue
            bs, computed_before = self.block_manager.block_size, seq.num_computed_tokens
            try:
                first_block = computed_before // bs
                self.kv_exchange.load(seq.block_table, remote.keys, first_block, remote.source)
            except (KeyError, ConnectionError) as exc:  # expired or unreachable: compute it
                log.warning("request %s: computing its prompt here: %s", seq.request_id, exc)
                continue
            seq.num_computed_tokens = seq.num_reused_tokens = remote.num_tokens
            self.block_manager.seal(seq, computed_before)
            batch[i] = (seq, min(num, seq.num_uncomputed))
        return batch

    def _load_features(self, seq: Sequence, remote: RemotePrefix) -> None:
        """Hand the prompt's target features stored beside its K/V to the feature listeners
        (the drafter starts warm). Missing or unreachable: the drafter starts after them."""
        if not self.runner.feature_layers:
            return
        tag = feature_tag(self.runner.feature_layers, self.runner.feature_normed)
        try:
            dtype = self.model.embed_tokens.weight.dtype
            loaded = self.kv_exchange.load_features(remote.keys, tag, dtype, remote.source)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            log.warning("request %s: prompt features not loaded: %s", seq.request_id, exc)
            return
        if loaded is not None:
            start, rows = loaded
            for listener in self.feature_listeners:
                listener(seq, rows.to(self.kv_cache.storage.device), start)

    def step(self) -> list[TokenOutput]:
        if self.overlap:
            return self._step_overlapped()
        batch = self._schedule()
        if not batch:
            return []
        trees = self._collect(self.speculator.submit(batch)) if self.speculator else {}
        return self._run(batch, trees)

    def _step_overlapped(self) -> list[TokenOutput]:
        """Run one lane's batch; before it, start drafting the other lane's next batch,
        so a drafter in another process works while this one is verified."""
        lane, other = self._lane, self._lane ^ 1
        self._lane = other
        if lane in self._pending:
            batch, pending = self._pending.pop(lane)
            batch = [(s, n) for s, n in batch if s.status is SequenceStatus.RUNNING]
        else:
            batch = self._schedule(lane)
            pending = self.speculator.submit(batch)
        if other not in self._pending:
            next_batch = self._schedule(other)
            if next_batch:
                self._pending[other] = (next_batch, self.speculator.submit(next_batch))
        trees = self._collect(pending)
        return self._run(batch, trees) if batch else []

    def _collect(self, pending: PendingDrafts) -> dict[Sequence, DraftTree]:
        start = time.perf_counter()
        trees = self.speculator.collect(pending)
        self.stats.draft_wait_seconds += time.perf_counter() - start
        return trees

    def _run(
        self, batch: list[tuple[Sequence, int]], trees: dict[Sequence, DraftTree]
    ) -> list[TokenOutput]:
        """Run the batch; if it fails, each sequence alone, so that one bad sequence fails
        itself (finished, in `failed`) rather than everyone in its step. A failed forward
        changes nothing that a rerun does not overwrite (its K/V slots, rewritten)."""
        try:
            return self._run_batch(batch, trees)
        except Exception as exc:
            if len(batch) == 1:
                self._fail(batch[0][0], exc)
                return []
            log.exception("a step of %d sequences failed; running each alone", len(batch))
        outputs = []
        for seq, num in batch:
            try:
                outputs += self._run_batch([(seq, num)], {seq: trees[seq]} if seq in trees else {})
            except Exception as exc:
                self._fail(seq, exc)
        return outputs

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        log.error("request %s failed its step: %r", seq.request_id, exc)
        self._finish(seq)
        self.failed[seq.request_id] = exc

    def take_failed(self) -> dict[str, Exception]:
        """The requests steps failed alone since the last call (already finished)."""
        failed, self.failed = self.failed, {}
        return failed

    def _run_batch(
        self, batch: list[tuple[Sequence, int]], trees: dict[Sequence, DraftTree]
    ) -> list[TokenOutput]:
        start = time.perf_counter()
        result = self.runner.step(batch, trees)
        self.stats.steps += 1
        self.stats.computed_tokens += sum(len(trees[s]) if s in trees else n for s, n in batch)
        for seq, num in batch:
            if seq not in trees:
                computed_before = seq.num_computed_tokens
                seq.num_computed_tokens += num
                self.block_manager.seal(seq, computed_before)
                for listener in self.feature_listeners if seq in result.features else ():
                    listener(seq, result.features[seq], computed_before)
        outputs, out = [], result.samples
        for i, seq in enumerate(result.sampled):
            outputs += self._emit(seq, [out.token_ids[i]], out.logprobs[i], out.top_logprobs[i])
        for seq, logits in result.tree_logits.items():
            tokens = self.speculator.verify(
                seq, trees[seq], logits, result.features.get(seq), result.node_states.get(seq)
            )
            outputs += self._emit(seq, tokens)
        seconds = time.perf_counter() - start
        self.stats.step_seconds += seconds
        for listener in self.step_listeners:
            listener(seconds)
        self.stats.generated_tokens += len(outputs)
        return outputs

    def _emit(
        self,
        seq: Sequence,
        tokens: list[int],
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
    ) -> list[TokenOutput]:
        """Append new tokens to `seq` up to the first that finishes it."""
        outputs = []
        for token in tokens:
            seq.token_ids.append(token)
            if seq.grammar is not None:
                seq.grammar.accept(token)
            reason = self._finish_reason(seq, token)
            outputs.append(
                TokenOutput(
                    seq.request_id,
                    token,
                    logprob,
                    top_logprobs,
                    reason,
                    seq.num_prompt_tokens,
                    seq.num_reused_tokens,
                )
            )
            if reason is not None:
                outputs[-1].spec = self._finish(seq)
                break
        return outputs

    def _finish(self, seq: Sequence) -> SpecStats | None:
        for listener in self.finish_listeners:
            listener(seq)
        self.sequences.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        return self.speculator.close(seq) if self.speculator else None

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion (tests, benchmarks). Returns generated token ids;
        raises if a step failed any of them (their partial outputs would pass for short
        answers)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self.sequences for rid in ids):
            for o in self.step():
                if o.request_id in results:
                    results[o.request_id].append(o.token_id)
        failed = {rid: self.failed.pop(rid) for rid in ids if rid in self.failed}
        if failed:
            rid, exc = next(iter(failed.items()))
            message = f"{len(failed)} of {len(ids)} requests failed ({rid}: {exc!r})"
            raise RuntimeError(message) from exc
        return [results[rid] for rid in ids]
