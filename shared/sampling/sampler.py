"""Batched token sampling: penalties, truncation, drawing, logprobs.

Every function is batch-vectorised over rows of a [B, V] logits tensor and keeps
tensors on the logits' device. `to_probs` and `draw` are the pieces speculative
verification reuses: `to_probs` is exactly the distribution `Sampler` draws from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from specmesh.kernels.cpu import load as load_cpu_kernels
from specmesh.shared.sampling.params import SamplingParams


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # raw log_softmax of the chosen token; None if not asked
    top_logprobs: list[list[tuple[int, float]] | None]  # (token_id, logprob), best first


def position_generator(
    seed: int | None, position: int, device: torch.device | str
) -> torch.Generator | None:
    """A fresh generator for drawing a seeded request's token at `position` (its index in
    prompt + output). Keyed by position rather than a running stream, a draw ignores the
    rest of the batch and how many draws came before it (speculation varies that)."""
    if seed is None:
        return None
    # A fixed mix (not Python's salted hash), so a seed means the same on every run and host.
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + position) % 2**63)


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _token_counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] occurrence counts; padding goes to an extra column that is dropped."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.tensor([s + [vocab] * (width - len(s)) for s in seqs], dtype=torch.long)
    ids = ids.reshape(len(seqs), width).to(device)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
) -> torch.Tensor:
    """Repetition (prompt+output) then frequency/presence (output only) penalties.

    Returns a new tensor (the caller keeps raw logits for logprobs); rows without
    penalties are left untouched and, if no row has any, `logits` itself is returned.
    """
    rows = [i for i, p in enumerate(params) if has_penalties(p)]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[-1]
    idx = torch.tensor(rows, device=dev)

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(params[i], name) for i in rows], device=dev)[:, None]

    out_counts = _token_counts([output_ids[i] for i in rows], vocab, dev)
    x = logits[idx].float()
    if any(params[i].repetition_penalty != 1.0 for i in rows):
        seen = (out_counts + _token_counts([prompt_ids[i] for i in rows], vocab, dev)) > 0
        rep = column("repetition_penalty")
        # HF/vLLM: shrink towards zero, i.e. divide positive logits, multiply negative ones.
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - column("frequency_penalty") * out_counts
    x = x - column("presence_penalty") * (out_counts > 0).to(x.dtype)
    out = logits.clone()
    out[idx] = x.to(out.dtype)
    return out


CANDIDATES = 256  # tokens sorted per row where no top_k bounds the kept ones


def _truncate(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) tokens outside top_k, then top_p, then min_p, in one stable
    descending sort (ties: lowest id first, as argmax): of a row's best few where they
    hold every token it keeps (`_best`), else of the whole row."""
    dev, vocab = logits.device, logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    # min_p keeps p >= min_p * p_max, i.e. logit >= max_logit + log(min_p); the ratio is
    # unchanged by renormalisation after top_k/top_p, so it can be tested on raw logits.
    log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params])
    min_logit = logits.max(dim=-1, keepdim=True).values + log_min_p.to(dev)[:, None]
    out = torch.full_like(logits, -math.inf)
    whole = torch.ones(len(logits), dtype=torch.bool, device=dev)  # rows sorted whole
    if (best := _best(logits, top_k, top_p, min_logit)) is not None:
        values, ids, log_total, whole = best
        out.scatter_(1, ids, _kept(values, top_k, top_p, min_logit, log_total))
    if whole.any():  # their rows of `out` are replaced whole
        values, ids = logits[whole].sort(dim=-1, descending=True, stable=True)
        kept = _kept(values, top_k[whole], top_p[whole], min_logit[whole], None)
        out[whole] = torch.full_like(values, -math.inf).scatter_(1, ids, kept)
    return out


def _kept(
    values: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_logit: torch.Tensor,
    log_total: torch.Tensor | None,
) -> torch.Tensor:
    """`values` [R, n], logits sorted stably in descending order, with those top_k, top_p
    and min_p drop at -inf; `log_total` [R, 1]: the log of the top_k-truncated softmax's
    denominator (None: `values` hold the whole rows)."""
    drop = torch.arange(values.shape[-1], device=values.device)[None, :] >= top_k[:, None]
    values = values.masked_fill(drop, -math.inf)
    probs = values.softmax(dim=-1) if log_total is None else (values - log_total).exp()
    # top_p keeps the shortest prefix reaching mass top_p: drop a token once the mass
    # before it already does. The top token is never dropped (top_p > 0, min_p <= 1).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p
    drop |= values < min_logit
    return values.masked_fill(drop, -math.inf)


def _best(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_logit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Each row's k best logits and their ids [B, k] in stable descending order, the log
    of its top_k-truncated softmax's denominator [B, 1], and [B] whether the row must be
    sorted whole instead: it keeps more than its k best (too little mass in them for its
    top_p, and min_p keeping the next best too), or a tie crosses the k-th place (the
    next best equals the k-th: topk keeps any of the tied). k: the largest top_k, at
    least CANDIDATES where a row has none; None where k is near V."""
    vocab = logits.shape[-1]
    bounded = top_k < vocab
    k = int(top_k[bounded].max()) if bounded.any() else 0
    if not bounded.all():
        k = max(k, CANDIDATES)
    if 8 * k > vocab:
        return None
    values, ids = logits.topk(k + 1, dim=-1)  # descending, ties in no set order
    next_best, values, ids = values[:, k:], values[:, :k], ids[:, :k]  # [B, 1], [B, k]
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    tied_out = ((next_best == values[:, -1:]) & (next_best > -math.inf))[:, 0]
    in_top_k = torch.arange(k, device=logits.device)[None, :] < top_k[:, None]
    log_total = torch.where(
        bounded[:, None],
        values.masked_fill(~in_top_k, -math.inf).logsumexp(-1, keepdim=True),
        logits.logsumexp(-1, keepdim=True),
    )
    # A margin over top_p: summed in another order than `_kept`'s cumsum.
    mass = (values - log_total).exp().sum(-1, keepdim=True)
    covered = (bounded[:, None] | (mass >= top_p + 1e-5) | (next_best < min_logit))[:, 0]
    return values, ids.gather(-1, by_value), log_total, tied_out | ~covered


def to_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The exact per-row sampling distribution (fp32): temperature, top_k, top_p, min_p.

    Rows with temperature 0 are one-hot on the argmax.
    """
    dev = logits.device
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=dev)[:, None]
    x = logits.float() / temps
    if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        x = _truncate(x, params)
    probs = x.softmax(dim=-1)
    if any(p.temperature == 0 for p in params):
        greedy = torch.tensor([p.temperature == 0 for p in params], device=dev)[:, None]
        one_hot = torch.zeros_like(probs).scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row from `probs` [B, V] (need not be normalised) -> [B] long.

    Exponential race: argmax(p / E), E ~ Exp(1) i.i.d., picks i with probability p_i.
    Each seeded row fills its own noise row from its generator; the rest use the global RNG.
    """
    noise = torch.empty_like(probs, dtype=torch.float32)
    if any(g is None for g in generators):
        noise.exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    # Exp(1) may return exactly 0; 0/0 = NaN would win argmax, so clamp.
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of [rows, vocab] logits (the first of equal maxima); fp32 on
    CPU through the kernels' vectorised pass, which a verified draft tree's ~10 rows of a
    large vocabulary feel."""
    kernel = load_cpu_kernels() if logits.device.type == "cpu" else None
    if kernel is not None and logits.dtype == torch.float32 and logits.dim() == 2:
        return kernel.argmax(logits.contiguous())
    return logits.argmax(dim=-1)


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
    ) -> SampleOutput:
        x = apply_penalties(logits, params, prompt_ids, output_ids)
        if all(p.greedy for p in params):
            tokens = greedy(x)  # fast path: no softmax, no RNG
        else:
            tokens = draw(to_probs(x, params), generators)
        token_ids: list[int] = tokens.tolist()
        out = SampleOutput(token_ids, [None] * len(params), [None] * len(params))
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            self._fill_logprobs(out, logits, tokens, params, want)
        return out

    @staticmethod
    def _fill_logprobs(
        out: SampleOutput,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        params: list[SamplingParams],
        want: list[int],
    ) -> None:
        # Logprobs are of the raw model distribution (vLLM's default), not the processed one.
        idx = torch.tensor(want, device=logits.device)
        lp = torch.log_softmax(logits[idx].float(), dim=-1)
        chosen = lp.gather(1, tokens[idx, None]).squeeze(1).tolist()
        k = max(params[i].logprobs or 0 for i in want)
        top_vals, top_ids = (t.tolist() for t in lp.topk(k, dim=-1))
        for j, i in enumerate(want):
            n = params[i].logprobs or 0
            out.logprobs[i] = chosen[j]
            out.top_logprobs[i] = list(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
