"""Sampling layer: distributions, RNG reproducibility, penalties, logprobs, validation."""

from __future__ import annotations

import math

import pytest
import torch
from specmesh.kernels.cpu import load as load_cpu_kernels
from specmesh.shared.core.sequence import Sequence
from specmesh.shared.runner.logits import processed_logits
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.sampling.sampler import (
    Sampler,
    apply_penalties,
    draw,
    greedy,
    position_generator,
    to_probs,
)

pytestmark = pytest.mark.unit

P = SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt: list[list[int]] | None = None,
    output: list[list[int]] | None = None,
    gens: list[torch.Generator | None] | None = None,
):
    n = len(params)
    return Sampler().sample(
        logits, params, prompt or [[]] * n, output or [[]] * n, gens or [None] * n
    )


def probs_logits(*p: float) -> torch.Tensor:
    """A one-row logits tensor whose softmax is exactly `p`."""
    return torch.tensor([p], dtype=torch.float64).log().float()


# --- greedy -----------------------------------------------------------------------------


def test_greedy_equals_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    state = torch.get_rng_state()
    out = sample(logits, [P(temperature=0)] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5 and out.top_logprobs == [None] * 5
    # The all-greedy fast path draws no random numbers.
    assert torch.equal(torch.get_rng_state(), state)


def test_greedy_is_torch_argmax_on_ties_nans_and_tails() -> None:
    """The kernels' argmax (a verified tree's rows) answers as torch's does: the first of
    equal maxima, the first NaN, index 0 of a row of -inf, in the vector lanes and in a
    tail past the last 8."""
    assert load_cpu_kernels() is not None  # this machine builds the CPU kernels
    torch.manual_seed(2)
    x = torch.randn(8, 49157)
    x[0, 100] = x[0, 40000] = 50.0
    x[1, 5000] = x[1, 7] = float("nan")
    x[2] = float("-inf")
    x[3] = 1.0
    x[4, 49156] = 50.0
    x[5, 49153] = float("nan")
    x[6, 8] = x[6, 3] = float("inf")
    for rows in (x, x[:, :5], x[:, :16].contiguous(), x[:1]):
        assert torch.equal(greedy(rows), rows.argmax(dim=-1))


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    params = [P(temperature=0), P(temperature=1.5), P(top_k=1, temperature=2), P()]
    for _ in range(20):
        out = sample(logits, params)
        assert out.token_ids[0] == logits[0].argmax().item()
        assert out.token_ids[2] == logits[2].argmax().item()


def test_top_k_1_equals_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 100)
    greedy = sample(logits, [P(temperature=0)] * 3).token_ids
    assert sample(logits, [P(top_k=1, temperature=0.7)] * 3).token_ids == greedy
    # to_probs agrees: top_k=1 is one-hot on the argmax, like temperature 0.
    expected = torch.nn.functional.one_hot(logits.argmax(-1), 100).float()
    assert torch.equal(to_probs(logits, [P(top_k=1, temperature=0.7)] * 3), expected)
    assert torch.equal(to_probs(logits, [P(temperature=0)] * 3), expected)


def test_greedy_property() -> None:
    assert P(temperature=0).greedy and P(top_k=1).greedy
    assert not P().greedy and not P(top_k=0).greedy and not P(top_k=2).greedy


# --- to_probs -------------------------------------------------------------------------


def check(logits: torch.Tensor, params: SamplingParams, expected: list[float]) -> None:
    got, want = to_probs(logits, [params])[0], torch.tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # Truncated tokens must be exactly zero, not merely small.
    assert torch.equal(got == 0, want == 0)


def test_temperature_matches_softmax() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, 40)
    temps = [0.3, 1.0, 1.9]
    got = to_probs(logits, [P(temperature=t) for t in temps])
    want = torch.softmax(logits / torch.tensor(temps)[:, None], dim=-1)
    torch.testing.assert_close(got, want)


def test_top_k() -> None:
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0]])
    s = math.exp(4) + math.exp(3)
    check(logits, P(top_k=2), [0, math.exp(4) / s, 0, math.exp(3) / s])
    check(logits, P(top_k=-1), torch.softmax(logits, -1)[0].tolist())
    check(logits, P(top_k=0), torch.softmax(logits, -1)[0].tolist())
    check(logits, P(top_k=10), torch.softmax(logits, -1)[0].tolist())


def test_top_p() -> None:
    logits = probs_logits(0.1, 0.2, 0.3, 0.4)
    # Keep the shortest prefix (by descending prob) whose mass reaches top_p.
    check(logits, P(top_p=0.35), [0, 0, 0, 1])
    check(logits, P(top_p=0.65), [0, 0, 0.3 / 0.7, 0.4 / 0.7])
    check(logits, P(top_p=0.75), [0, 0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9])
    check(logits, P(top_p=1.0), [0.1, 0.2, 0.3, 0.4])


def test_min_p() -> None:
    logits = probs_logits(0.1, 0.2, 0.3, 0.4)
    check(logits, P(min_p=0.6), [0, 0, 0.3 / 0.7, 0.4 / 0.7])  # keep p >= 0.24
    check(logits, P(min_p=0.45), [0, 0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9])  # keep p >= 0.18
    check(logits, P(min_p=1.0), [0, 0, 0, 1])


def test_top_p_applies_after_top_k() -> None:
    logits = probs_logits(0.1, 0.2, 0.3, 0.4)
    # Alone, top_p=0.75 keeps 3 tokens; after top_k=3 renormalises to (2, 3, 4)/9 the mass
    # before the third token is 7/9 >= 0.75, so only 2 remain.
    check(logits, P(top_k=3, top_p=0.75), [0, 0, 0.3 / 0.7, 0.4 / 0.7])


def test_temperature_before_truncation() -> None:
    # T=0.5 squares the probabilities: (1, 4, 9, 16)/30, so top_p=0.5 keeps only 16/30.
    check(probs_logits(0.1, 0.2, 0.3, 0.4), P(temperature=0.5, top_p=0.5), [0, 0, 0, 1])
    check(probs_logits(0.1, 0.2, 0.3, 0.4), P(temperature=0.5, top_p=0.6), [0, 0, 9 / 25, 16 / 25])


def test_mixed_rows_are_independent() -> None:
    logits = probs_logits(0.1, 0.2, 0.3, 0.4).repeat(4, 1)
    params = [P(top_k=2), P(top_p=0.65), P(min_p=0.45), P(temperature=0)]
    got = to_probs(logits, params)
    for row, p in zip(got, params, strict=True):
        torch.testing.assert_close(row, to_probs(logits[:1], [p])[0])


def truncated_by_whole_sort(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The definition: one row sorted whole (ties: lowest id first), then top_k, top_p on
    the renormalised rest, min_p against the best."""
    values, order = row.sort(descending=True, stable=True)
    keep = torch.arange(len(row)) < (p.top_k if p.top_k > 0 else len(row))
    values = values.masked_fill(~keep, -math.inf)
    probs = values.softmax(-1)
    keep &= probs.cumsum(-1) - probs < p.top_p
    keep &= values >= values[0] + (math.log(p.min_p) if p.min_p else -math.inf)
    return torch.full_like(row, -math.inf).scatter(0, order, values.masked_fill(~keep, -math.inf))


@pytest.mark.parametrize("ties", [False, True])
def test_truncation_sorts_a_rows_best_few_as_if_it_sorted_the_whole_row(ties: bool) -> None:
    """Rows whose kept tokens lie among their best few sort only those: the same tokens
    kept, ties and all, as sorting all 8,192; rows that keep more (flat, or a tie across
    the cut) are sorted whole, in the same batch."""
    gen = torch.Generator().manual_seed(int(ties))
    logits = torch.randn(12, 8192, generator=gen) * torch.linspace(0.5, 8, 12)[:, None]
    if ties:  # many equal logits, some rows mostly masked out
        logits = (logits * 2).round() / 2
        logits[::3, :8000] = -math.inf
    params = [P(top_k=20), P(top_p=0.9), P(min_p=0.05), P(top_k=300, top_p=0.8)] * 3
    got = to_probs(logits, params)
    for row, p, probs in zip(logits, params, got, strict=True):
        want = truncated_by_whole_sort(row, p).softmax(-1)
        assert torch.equal(probs > 0, want > 0)
        torch.testing.assert_close(probs, want)


# --- randomness -----------------------------------------------------------------------


def test_seed_reproducible_regardless_of_batch() -> None:
    torch.manual_seed(4)
    logits = torch.randn(1, 1000) * 0.1  # nearly flat: a tiny RNG change shows

    def run(batch: int, pos: int, others_seeded: bool, seed: int = 1234) -> list[int]:
        params = [P(temperature=1.0, top_p=0.9) for _ in range(batch)]
        x = logits.repeat(batch, 1)
        tokens = []
        for position in range(10, 18):  # eight decode steps
            gens = [
                position_generator(100 + i if others_seeded else None, position, "cpu")
                for i in range(batch)
            ]
            gens[pos] = position_generator(seed, position, "cpu")
            tokens.append(sample(x, params, gens=gens).token_ids[pos])
        return tokens

    ref = run(1, 0, False)
    assert len(set(ref)) > 1  # each position draws afresh
    assert run(1, 0, False) == ref
    assert run(5, 3, False) == ref
    assert run(7, 6, True) == ref
    assert run(1, 0, False, seed=4321) != ref


def test_position_generator() -> None:
    assert position_generator(None, 3, "cpu") is None

    def draws(seed: int, position: int, device: str | torch.device = "cpu") -> torch.Tensor:
        gen = position_generator(seed, position, device)
        assert gen is not None
        return torch.rand(5, generator=gen)

    # Fresh each time: the same seed and position give the same draws, on any call.
    assert torch.equal(draws(7, 3), draws(7, 3))
    assert torch.equal(draws(7, 3), draws(7, 3, torch.device("cpu")))
    assert not torch.equal(draws(7, 3), draws(7, 4))
    assert not torch.equal(draws(7, 3), draws(8, 3))
    assert not torch.equal(draws(1, 0), draws(0, 1))  # seed and position do not mix up
    assert not torch.equal(draws(-1, 0), draws(1, 0))


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    assert (counts[~support] == 0).all(), "drew a token with zero probability"
    expected = probs.double()[support] * tokens.numel()
    return float(((counts[support] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_frequencies_match_to_probs(seeded: bool) -> None:
    torch.manual_seed(5)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, 3.0, -0.5, 0.5]])
    params = P(temperature=0.8, top_k=6, top_p=0.97)
    probs = to_probs(logits, [params])[0]
    assert int((probs > 0).sum()) == 5  # both truncations are active
    n = 20_000
    # Seeded: one position per row, so draws keyed by position must be as good as a stream.
    gens = [position_generator(99, i, "cpu") if seeded else None for i in range(n)]
    tokens = torch.tensor(sample(logits.repeat(n, 1), [params] * n, gens=gens).token_ids)
    # 4 degrees of freedom: P(chi2 > 25) ~ 5e-5; the seed is fixed, so this is deterministic.
    assert chi_square(tokens, probs) < 25


def test_draw_handles_unnormalised_weights() -> None:
    torch.manual_seed(6)
    weights = torch.tensor([0.0, 3.0, 1.0, 0.0])
    tokens = draw(weights.repeat(20_000, 1), [None] * 20_000)
    assert chi_square(tokens, weights / weights.sum()) < 20


# --- penalties ------------------------------------------------------------------------

RAW = [2.0, -1.0, 0.5, 3.0, -2.0]
PROMPT, OUTPUT = [0], [1, 1, 3]


def penalised(params: SamplingParams) -> list[float]:
    logits = torch.tensor([RAW])
    out = apply_penalties(logits, [params], [PROMPT], [OUTPUT])
    assert logits.tolist() == [RAW], "input logits must not be modified"
    return out[0].tolist()


def test_repetition_penalty() -> None:
    # Seen in prompt or output: {0, 1, 3}; positive logits divided, negative multiplied.
    assert penalised(P(repetition_penalty=2.0)) == [1.0, -2.0, 0.5, 1.5, -2.0]
    assert penalised(P(repetition_penalty=0.5)) == [4.0, -0.5, 0.5, 6.0, -2.0]


def test_frequency_penalty() -> None:
    # Output counts only: token 1 twice, token 3 once; prompt token 0 untouched.
    assert penalised(P(frequency_penalty=0.5)) == [2.0, -2.0, 0.5, 2.5, -2.0]


def test_presence_penalty() -> None:
    assert penalised(P(presence_penalty=0.25)) == [2.0, -1.25, 0.5, 2.75, -2.0]
    assert penalised(P(presence_penalty=-1.0)) == [2.0, 0.0, 0.5, 4.0, -2.0]


def test_penalties_combined_and_rows_skipped() -> None:
    logits = torch.tensor([RAW, RAW])
    params = [P(), P(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)]
    out = apply_penalties(logits, params, [PROMPT, PROMPT], [OUTPUT, OUTPUT])
    assert out[0].tolist() == RAW
    # Repetition first, then frequency and presence.
    assert out[1].tolist() == [1.0, -2.0 - 1.0 - 0.25, 0.5, 1.5 - 0.5 - 0.25, -2.0]
    assert apply_penalties(logits, [P(), P()], [PROMPT] * 2, [OUTPUT] * 2) is logits


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([RAW])
    assert sample(logits, [P(temperature=0)]).token_ids == [3]
    # Frequency penalty 2 drops token 3 from 3.0 to 1.0, below token 0's 2.0.
    out = sample(logits, [P(temperature=0, frequency_penalty=2.0)], [PROMPT], [OUTPUT])
    assert out.token_ids == [0]


# --- logprobs -------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(7)
    logits = torch.randn(3, 64)
    params = [
        P(temperature=0.5, top_k=5, repetition_penalty=1.5, logprobs=4),
        P(logprobs=None),
        P(temperature=0, logprobs=0),
    ]
    gens = [position_generator(1, 0, "cpu"), None, None]
    out = sample(logits, params, [[1, 2, 3]] * 3, [[4, 5]] * 3, gens)
    raw = torch.log_softmax(logits, dim=-1)
    for i in (0, 2):
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert out.top_logprobs[2] == []
    top = out.top_logprobs[0]
    assert top is not None and len(top) == 4
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    want_v, want_i = raw[0].topk(4)
    assert [t for t, _ in top] == want_i.tolist()
    assert values == pytest.approx(want_v.tolist(), abs=1e-6)


# --- validation -----------------------------------------------------------------------


def test_defaults_and_boundaries_are_valid() -> None:
    P().validate()
    P(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, logprobs=20, max_tokens=1).validate()
    P(temperature=2, frequency_penalty=-2, presence_penalty=2, repetition_penalty=0.1).validate()
    P(seed=0, logprobs=0, stop_token_ids=[0, 2]).validate()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.1),
        ("presence_penalty", -2.1),
        ("logprobs", -1),
        ("logprobs", 21),
        ("max_tokens", 0),
        ("stop_token_ids", [-1]),
        ("seed", 1.5),
    ],
)
def test_validate_rejects(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        P(**{field: value}).validate()


def test_min_tokens_on_a_model_without_eos_leaves_the_logits() -> None:
    """Nothing can end the output early, so there is nothing to mask (was a 500: an empty
    float index tensor)."""
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=4, min_tokens=2))
    logits = torch.randn(1, 10)
    assert torch.equal(processed_logits(logits, seq, [[]], frozenset()), logits)
    masked = processed_logits(logits, seq, [[]], frozenset({3}))
    assert masked[0, 3] == float("-inf") and torch.equal(masked[0, :3], logits[0, :3])
