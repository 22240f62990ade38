"""Gated DeltaNet token mixing (Qwen3-Next's `linear_attention` layers) over the flat token
layout, with the recurrent state of each sequence kept per KV block.

Per token t, on channels x_t = [q; k; v] after a causal depthwise convolution of width K
and SiLU, with q and k L2-normalised per head and q scaled by 1/sqrt(Dk):

    S_t = exp(g_t) * S_{t-1}                              decay, g_t < 0
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T        delta-rule write   S: [Dk, Dv]
    o_t = S_t^T q_t

per value head, then o_t is RMS-normed and gated by silu(z_t). A token's state (the last
K-1 convolution inputs and S) follows from its parent's alone, so any set of chains and
draft trees is computed in waves: wave d holds every row at depth d of its span and reads
its parents' states from wave d-1 (wave 0 reads the sequence's cached state). Long chains
(prefill) instead take the closed form of DeltaNet's UT transform over segments of rows,
a few matmuls per segment (`_delta_segment`).

The cached state lives beside the paged K/V: each KV block has a state slot holding the
state after the last computed token in that block. A full block's slot is therefore the
state at its end, which is what a prefix-cache hit on that block resumes from, and the
slot of the block holding a sequence's last computed token is its running state. Layers
never write slots: they return the states after the rows a step keeps
(`LinearMetadata.kept`), and the runner (chains) or the verifier (the accepted path of a
tree) writes them once the step succeeded, so a failed or rejected step changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.layers import Linear
from torch import nn


@dataclass
class LinearStates:
    """One linear-attention layer's state slots, one per KV block."""

    conv: torch.Tensor  # [num_blocks, conv_dim, K-1] last convolution inputs, model dtype
    recurrent: torch.Tensor  # [num_blocks, v_heads, Dk, Dv] S, fp32


def snapshot_offsets(start: int, num: int, block_size: int) -> list[int]:
    """Of `num` tokens computed at positions start.., the offsets whose state a block slot
    keeps: the last token in each block they touch."""
    return [i for i in range(num) if (start + i + 1) % block_size == 0 or i == num - 1]


# Chains of at least this many rows take the closed form (segments of at most
# SEGMENT_ROWS); shorter ones, decode rows and trees go token by token in waves.
LONG_CHAIN = 8
SEGMENT_ROWS = 64  # as transformers' chunk size: exp(cumulative decay) stays in range


@dataclass
class Wave:
    rows: torch.Tensor  # [n] batch rows at this depth
    # [n] wave 0: the block whose slot holds the state before the row (-1: a zero state);
    # later waves: the index of the row's parent in the previous wave
    source: torch.Tensor
    kept_at: torch.Tensor  # [m] indices into `rows` of the rows kept
    kept_to: torch.Tensor  # [m] their index among the kept states


@dataclass
class Chain:
    """A long run of one sequence's new rows (a prefill chunk), computed segment by segment
    in closed form rather than token by token."""

    first: int  # its first batch row
    num: int  # its rows
    source: int  # the block whose slot holds the state before it (-1: a zero state)
    ends: list[int]  # offsets of the rows whose states are kept (block ends, the last)
    kept_to: list[int]  # their index among the kept states


@dataclass
class LinearMetadata:
    waves: list[Wave]  # every row not in a long chain
    chains: list[Chain]
    num_kept: int
    # (index among the kept states, block slot): chain snapshots the runner writes
    chain_slots: list[tuple[int, int]]
    # per span: the index among the kept states of its first tree node (None: a chain)
    tree_first_kept: list[int | None]
    # filled by each layer's forward: layer -> (conv [num_kept, C, K-1], recurrent
    # [num_kept, Hv, Dk, Dv]) states after the kept rows
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def build(
        cls, spans: list[SequenceSpan], block_size: int, device: torch.device
    ) -> LinearMetadata:
        parents: dict[int, int] = {}  # wave rows -> their parent row (-1: cached state)
        sources, kept_rows, chains, chain_slots, tree_first = {}, [], [], [], []
        base = 0
        for span in spans:
            n, start = span.num_new, span.num_cached
            before = span.block_table[(start - 1) // block_size] if start > 0 else -1
            if span.mask is None:  # each block keeps the state after its last row
                ends = snapshot_offsets(start, n, block_size)
                kept = list(range(len(kept_rows), len(kept_rows) + len(ends)))
                blocks = [span.block_table[(start + i) // block_size] for i in ends]
                chain_slots += zip(kept, blocks, strict=True)
                kept_rows += [base + i for i in ends]
                tree_first.append(None)
            else:  # which nodes' states are kept depends on what is accepted: all of them
                tree_first.append(len(kept_rows))
                kept_rows += range(base, base + n)
            if span.mask is None and n >= LONG_CHAIN:
                chains.append(Chain(base, n, before, ends, kept))
            else:
                for i, p in enumerate(_parents(span)):
                    parents[base + i] = base + p if p >= 0 else -1
                    sources[base + i] = before if p < 0 else -1
            base += n
        waves = _waves(parents, sources, kept_rows, device)
        return cls(waves, chains, len(kept_rows), chain_slots, tree_first)


def _parents(span: SequenceSpan) -> list[int]:
    """Each new token's parent among the span's new tokens (-1: its state is cached)."""
    if span.mask is None:
        return list(range(-1, span.num_new - 1))
    # A tree node's ancestors are a chain of earlier nodes: the parent is the latest one.
    below = span.mask.tril(-1)
    latest = (below * torch.arange(span.num_new)).amax(dim=1)
    return [int(p) if below[i].any() else -1 for i, p in enumerate(latest)]


def _waves(
    parents: dict[int, int], sources: dict[int, int], kept_rows: list[int], device: torch.device
) -> list[Wave]:
    depth: dict[int, int] = {}
    place: dict[int, int] = {}
    by_depth: list[list[int]] = []
    for row, parent in parents.items():  # rows ascending: parents come before children
        depth[row] = 0 if parent < 0 else depth[parent] + 1
        if depth[row] == len(by_depth):
            by_depth.append([])
        place[row] = len(by_depth[depth[row]])
        by_depth[depth[row]].append(row)
    kept_index = {row: i for i, row in enumerate(kept_rows)}
    waves = []
    for d, rows in enumerate(by_depth):
        source = [sources[r] if d == 0 else place[parents[r]] for r in rows]
        kept = [(i, kept_index[r]) for i, r in enumerate(rows) if r in kept_index]
        at, to = zip(*kept, strict=True) if kept else ((), ())
        tensors = (torch.tensor(x, dtype=torch.long, device=device) for x in (rows, source, at, to))
        waves.append(Wave(*tensors))
    return waves


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then times silu(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        lin = cfg.linear
        assert lin is not None, "linear-attention layer of a config without them"
        self.index = index
        self.nk, self.nv, self.dk, self.dv = (
            lin.num_k_heads,
            lin.num_v_heads,
            lin.head_k_dim,
            lin.head_v_dim,
        )
        group = self.nv // self.nk  # value heads per key head
        # Per key head: [q (Dk), k (Dk), v (group*Dv), z (group*Dv)], as the checkpoint has it.
        self.in_proj_qkvz = Linear(
            cfg.hidden_size, self.nk * (2 * self.dk + 2 * group * self.dv), bias=False
        )
        self.in_proj_ba = Linear(cfg.hidden_size, 2 * self.nv, bias=False)  # per key head: [b; a]
        conv_dim = lin.conv_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, lin.conv_kernel, groups=conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.nv * self.dv, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, states: LinearStates, meta: LinearMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; the states after the kept rows go to meta.kept."""
        t, group = len(x), self.nv // self.nk
        q, k, v, z = (
            self.in_proj_qkvz(x)
            .view(t, self.nk, -1)
            .split([self.dk, self.dk, group * self.dv, group * self.dv], dim=-1)
        )
        b, a = self.in_proj_ba(x).view(t, self.nk, 2 * group).split([group, group], dim=-1)
        channels = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        beta = b.reshape(t, self.nv).float().sigmoid()  # [T, Hv] write strength
        # g = -exp(A_log) * softplus(a + dt_bias) [T, Hv]: the log of each step's decay
        g = -self.A_log.float().exp() * F.softplus(a.reshape(t, self.nv).float() + self.dt_bias)
        out = self._recur(channels, beta, g, states, meta)  # [T, Hv, Dv] fp32
        out = self.norm(out.to(x.dtype), z.reshape(t, self.nv, self.dv))
        return self.out_proj(out.reshape(t, -1))

    def _recur(
        self,
        channels: torch.Tensor,
        beta: torch.Tensor,
        g: torch.Tensor,
        states: LinearStates,
        meta: LinearMetadata,
    ) -> torch.Tensor:
        """The convolution and delta rule: long chains in closed form, the other rows along
        their ancestry wave by wave."""
        weight = self.conv1d.weight[:, 0]  # [C, K]
        out = channels.new_empty(len(channels), self.nv, self.dv, dtype=torch.float32)
        kept_conv = states.conv.new_empty(meta.num_kept, *states.conv.shape[1:])
        kept_rec = states.recurrent.new_empty(meta.num_kept, *states.recurrent.shape[1:])
        for chain in meta.chains:
            rows = slice(chain.first, chain.first + chain.num)
            conv, rec = _cached(states, torch.tensor([chain.source], device=channels.device))
            out[rows], conv_kept, rec_kept = self._chain(
                channels[rows], beta[rows], g[rows], conv[0], rec[0], chain.ends
            )
            kept_conv[chain.kept_to] = conv_kept.to(kept_conv.dtype)
            kept_rec[chain.kept_to] = rec_kept
        conv = rec = None
        for d, wave in enumerate(meta.waves):
            if d == 0:
                conv, rec = _cached(states, wave.source)
            else:
                conv, rec = conv[wave.source], rec[wave.source]
            window = torch.cat([conv.to(channels.dtype), channels[wave.rows, :, None]], dim=-1)
            conv = window[:, :, 1:]  # [n, C, K-1]
            qkv = F.silu((window * weight).sum(-1)).float()  # [n, C]
            rec, out[wave.rows] = self._delta_rule(qkv, rec, beta[wave.rows], g[wave.rows])
            kept_conv[wave.kept_to] = conv[wave.kept_at].to(kept_conv.dtype)
            kept_rec[wave.kept_to] = rec[wave.kept_at]
        meta.kept[self.index] = (kept_conv, kept_rec)
        return out

    def _chain(
        self,
        channels: torch.Tensor,
        beta: torch.Tensor,
        g: torch.Tensor,
        conv: torch.Tensor,
        rec: torch.Tensor,
        ends: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence's run of n rows from state (conv [C, K-1], rec [Hv, Dk, Dv]):
        (output [n, Hv, Dv], the conv and recurrent states after the rows at `ends`)."""
        width = conv.shape[1]
        window = torch.cat([conv.to(channels.dtype), channels.T], dim=1)  # [C, K-1+n]
        weight = self.conv1d.weight  # [C, 1, K]
        qkv = F.silu(F.conv1d(window[None], weight, groups=len(weight))[0]).T.float()
        conv_kept = torch.stack([window[:, e + 1 : e + 1 + width] for e in ends])
        q, k, v = self._heads(qkv)
        out, rec_kept, start = torch.empty_like(v), [], 0
        for end in ends:  # segments end where a state is kept, SEGMENT_ROWS at most
            for a in range(start, end + 1, SEGMENT_ROWS):
                b = min(a + SEGMENT_ROWS, end + 1)
                out[a:b], rec = _delta_segment(q[a:b], k[a:b], v[a:b], beta[a:b], g[a:b], rec)
            rec_kept.append(rec)
            start = end + 1
        return out, conv_kept, torch.stack(rec_kept)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved channels [n, C] -> q and k [n, Hv, Dk] (L2-normed, q over sqrt(Dk)), v
        [n, Hv, Dv]; each key head serves `group` consecutive value heads."""
        n, group = len(qkv), self.nv // self.nk
        q, k, v = qkv.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
        q, k = (_l2norm(x.view(n, self.nk, self.dk)).repeat_interleave(group, 1) for x in (q, k))
        return q / self.dk**0.5, k, v.view(n, self.nv, self.dv)

    def _delta_rule(
        self, qkv: torch.Tensor, rec: torch.Tensor, beta: torch.Tensor, g: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row: qkv [n, C], rec [n, Hv, Dk, Dv], beta and g [n, Hv] ->
        (the new rec, the output [n, Hv, Dv])."""
        q, k, v = self._heads(qkv)
        rec = rec * g.exp()[:, :, None, None]
        delta = (v - (rec * k[..., None]).sum(-2)) * beta[..., None]  # [n, Hv, Dv]
        rec = rec + k[..., None] * delta[:, :, None, :]
        return rec, (rec * q[..., None]).sum(-2)


def _delta_segment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    rec: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens of the delta rule at once (the UT transform of DeltaNet): q, k [L, H, Dk],
    v [L, H, Dv], beta and g [L, H], from S = rec [H, Dk, Dv] -> (output [L, H, Dv], S after).

    With G_i = g_1 + ... + g_i and D_ij = exp(G_i - G_j) for j <= i, the writes solve
    (I + tril(diag(beta) K K^T * D, -1)) U = diag(beta) V - diag(beta exp(G)) K S, then
    o_i = exp(G_i) q_i S + sum_{j<=i} D_ij (q_i . k_j) u_j and
    S' = exp(G_L) S + sum_j exp(G_L - G_j) k_j u_j^T."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [H, L, D]
    beta, cum = beta.T[..., None], g.T.cumsum(-1)  # [H, L, 1], [H, L]
    length = cum.shape[1]
    upper = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k * beta) @ k.transpose(1, 2) * decay  # its diagonal is taken as ones
    rhs = torch.cat([v * beta, k * beta * cum.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    writes = solved[..., : v.shape[-1]] - solved[..., v.shape[-1] :] @ rec  # U [H, L, Dv]
    out = (q * cum.exp()[..., None]) @ rec + (q @ k.transpose(1, 2) * decay) @ writes
    last = cum[:, -1:]  # [H, 1]
    rec = rec * last.exp()[..., None] + (k * (last - cum).exp()[..., None]).transpose(1, 2) @ writes
    return out.transpose(0, 1), rec


def _cached(states: LinearStates, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The states in the slots of `blocks` [n] (zeros where -1: a sequence's first token)."""
    fresh = (blocks < 0)[:, None, None]
    conv = states.conv[blocks.clamp(min=0)].masked_fill(fresh, 0)
    rec = states.recurrent[blocks.clamp(min=0)].masked_fill(fresh[..., None], 0)
    return conv, rec
