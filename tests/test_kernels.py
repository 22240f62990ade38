"""The Triton kernels against their references (`kernels.check`), under Triton's interpreter
where there is no GPU: tiny shapes, ragged sequences, partial blocks, GQA groups of 2 and 3;
and through Triton's compiler for a Hopper GPU (`kernels.check.compile`), which is stricter
than the interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from specmesh.kernels.check.result import Result, table
from specmesh.kernels.check.suite import device, run
from specmesh.shared.core.tree import DraftTree

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)

KERNELS = {
    "attention (mixed step)",
    "attention (decode)",
    "accept greedy",
    "accept sampling",
    "kv blocks pack (export)",
    "kv blocks unpack (load)",
    "kv move (commit paths)",
}


@pytest.fixture(scope="module")
def dev() -> str:
    return device()  # the interpreter where there is no GPU, before any kernel is defined


@pytest.mark.unit
def test_every_kernel_matches_its_reference(dev: str) -> None:
    results = run(small=True)
    assert {r.kernel for r in results} == KERNELS
    assert all(r.passed for r in results), table(results)


@pytest.mark.unit
def test_attention_check_fails_on_a_wrong_mask(dev: str) -> None:
    from specmesh.kernels.check import attention

    case = attention.cases(dev, torch.float32, small=True)[0]
    assert any(s.mask is not None for s in case.spans)
    ref, ref_k, _ = attention.reference(case)
    out, k_cache, _ = attention.kernel(case)
    assert torch.equal(k_cache, ref_k)  # the new tokens' K/V written where torch writes them
    assert Result.close("", "", out, ref, 1e-4).passed
    causal = attention.kernel(case, attention.causal(case))[0]
    assert not Result.close("", "", causal, ref, 1e-4).passed


@pytest.mark.unit
def test_accept_takes_the_first_matching_child(dev: str) -> None:
    """Two children of the root propose the target's token: both rules take the first."""
    from specmesh.kernels.check import accept

    tree = DraftTree([9, 5, 5, 7], [-1, 0, 0, 2])
    assert accept.greedy_kernel([tree], [[5, 1, 7, 3]], dev) == [([0, 1], [5, 1])]
    probs = torch.nn.functional.one_hot(torch.tensor([5, 1, 7, 3]), 10).float()
    assert accept.sampling_kernel([tree], [probs.to(dev)], [(1, 0)]) == [([0, 1], [5, 1])]


@pytest.mark.unit
def test_kv_move_check_fails_on_wrong_positions(dev: str) -> None:
    from specmesh.kernels.check import kv_move

    case = kv_move.make_case(dev, torch.float32, small=True)
    assert not torch.equal(case.cache.storage, case.reference.storage)  # tokens do move
    kv_move.commit_on_device(case, [max(start - 1, 0) for start in case.starts])
    assert not torch.equal(case.cache.storage, case.reference.storage)


def test_kernels_compile_for_a_gpu() -> None:
    # A process of its own: the interpreter, on in this one, compiles nothing.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "specmesh.kernels.check.compile"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "sm_90: compiled" in done.stdout
