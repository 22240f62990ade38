"""Where services compute: CPU lists, the placement `specmesh up` plans, what a process
applies to itself, and the CPU kernels' thread pool (results, nesting, concurrent
callers, a fork, a busy neighbour)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from specmesh.kernels.cpu import load as load_cpu_kernels
from specmesh.shared.cores import CoresConfig, format_cpus, parse_cpus, plan_cores, usable_cpus

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_cpu_lists_parse_and_format_as_cpusets() -> None:
    assert parse_cpus("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpus(" 5 ,1-2") == [1, 2, 5]
    assert format_cpus([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    for bad in ("", "a-b", "3-", "-1", "0,,1"):
        with pytest.raises(ValueError, match="--cpus"):
            parse_cpus(bad)
    with pytest.raises(ValueError, match="--cpus"):
        CoresConfig(cpus="x")
    with pytest.raises(ValueError, match="--threads"):
        CoresConfig(threads=0)


@pytest.mark.unit
def test_few_cores_are_shared_by_every_service() -> None:
    counts = {"tokenizer": 1, "prefill": 1, "decode": 1, "drafter": 1, "gateway": 1}
    plan = plan_cores([0, 1], counts)
    assert all(c.cpus is None for c in plan.values())
    assert plan["decode-0"].threads == plan["prefill-0"].threads == 2
    assert plan["drafter-0"].threads == 2
    assert plan["tokenizer-0"].threads == plan["gateway-0"].threads == 1


@pytest.mark.unit
def test_decode_workers_get_cores_of_their_own_on_a_large_machine() -> None:
    counts = {"tokenizer": 2, "prefill": 1, "decode": 2, "drafter": 1, "gateway": 1}
    plan = plan_cores(list(range(16)), counts)
    # A quarter (4 cores) for everything else, the other 12 split between the 2 workers.
    assert (plan["decode-0"].cpus, plan["decode-0"].threads) == ("0-5", 6)
    assert (plan["decode-1"].cpus, plan["decode-1"].threads) == ("6-11", 6)
    for instance in ("prefill-0", "drafter-0", "tokenizer-0", "tokenizer-1", "gateway-0"):
        assert plan[instance].cpus == "12-15"
    assert plan["prefill-0"].threads == 4
    # Too few cores for 4 workers to own 2 each besides the rest: all share.
    crowded = plan_cores(list(range(8)), {**counts, "decode": 4})
    assert all(c.cpus is None for c in crowded.values())
    assert crowded["decode-3"].threads == 8


def _placed(*args: str) -> str:
    code = (
        "import os; from specmesh.shared.cores import CoresConfig, place_process;"
        f"n = place_process(CoresConfig({', '.join(args)}));"
        "print(n, sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0),"
        " os.environ['OMP_NUM_THREADS'], os.environ['RAYON_NUM_THREADS'])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.unit
def test_a_process_pins_renices_and_sizes_its_threads() -> None:
    cpu = min(os.sched_getaffinity(0))
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    kept = 7 if os.geteuid() == 0 or nice <= 7 else nice  # lowering it needs CAP_SYS_NICE
    assert _placed(f"cpus='{cpu}'", "nice=7") == f"1 [{cpu}] {kept} 1 1"
    assert _placed("threads=3").split()[0] == "3"


@pytest.mark.unit
def test_a_background_process_runs_at_idle_policy() -> None:
    code = (
        "import os, threading; from specmesh.shared.cores import CoresConfig, place_process;"
        "place_process(CoresConfig(idle=True)); policy = [];"
        "t = threading.Thread(target=lambda: policy.append(os.sched_getscheduler(0)));"
        "t.start(); t.join(); print(os.sched_getscheduler(0), policy[0], os.SCHED_IDLE)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    main, thread, idle = out.stdout.split()
    assert main == thread == idle  # threads started later inherit it


@pytest.mark.unit
def test_default_threads_follow_the_cgroup_quota(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == cpus  # no cpu.max: no cgroup v2 limit
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == cpus
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: 2 threads, at most
    assert usable_cpus(tmp_path) == min(cpus, 2)
    (tmp_path / "cpu.max").write_text("20000 100000\n")
    assert usable_cpus(tmp_path) == 1


@pytest.mark.unit
def test_a_cpu_the_machine_lacks_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="--cpus 4096"):
        from specmesh.shared.cores import place_process

        place_process(CoresConfig(cpus="4096"))


# As in test_model_ops: where the kernels do not build, the pool does not exist either.
needs_kernels = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels do not build here"
)


@pytest.fixture
def kernel():  # noqa: ANN201
    module = load_cpu_kernels()
    before = module.get_num_threads()
    yield module
    module.set_num_threads(before)


@pytest.mark.unit
@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_the_pool_computes_every_column_once_at_any_thread_count(kernel, threads: int) -> None:
    kernel.set_num_threads(threads)
    assert kernel.get_num_threads() == threads
    torch.manual_seed(threads)
    weight, bias = torch.randn(1000, 96), torch.randn(1000)
    blocked = kernel.block_weight(weight)
    for rows in (1, 7, 100):
        x = torch.randn(rows, 96)
        got = kernel.blocked_linear(x, blocked, 1000, bias, None)
        torch.testing.assert_close(got, x @ weight.T + bias, rtol=1e-4, atol=1e-4)


@pytest.mark.unit
@needs_kernels
def test_the_pool_serves_callers_on_several_threads_at_once(kernel) -> None:
    kernel.set_num_threads(2)
    weight = torch.randn(512, 64)
    blocked = kernel.block_weight(weight)
    failures: list[str] = []

    def caller(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(50):
            x = torch.randn(3, 64, generator=gen)
            got = kernel.blocked_linear(x, blocked, 512, torch.empty(0), None)
            if not torch.allclose(got, x @ weight.T, rtol=1e-4, atol=1e-4):
                failures.append(f"caller {seed}")

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a region never finished"
    assert failures == []


POOL_SCRIPT = """
import os, subprocess, sys, time, torch
from specmesh.kernels.cpu import load
kernel = load()
kernel.set_num_threads(2)
weight = torch.randn(2048, 256)
blocked = kernel.block_weight(weight)
x = torch.randn(4, 256)
want = x @ weight.T
def check():
    got = kernel.blocked_linear(x, blocked, 2048, torch.empty(0), None)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
check()  # the parent's pool is running when it forks
pid = os.fork()
if pid == 0:
    check()  # the child has none of its parent's threads: it starts its own pool
    os._exit(0)
assert os.waitpid(pid, 0)[1] == 0
busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
try:
    start = time.perf_counter()
    for _ in range(200):
        check()
    print(time.perf_counter() - start)
finally:
    busy.kill()
"""


@pytest.mark.unit
@needs_kernels
def test_the_pool_survives_a_fork_and_a_busy_neighbour() -> None:
    out = subprocess.run(
        [sys.executable, "-c", POOL_SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr


BACK_TO_BACK_SCRIPT = """
import time, torch
from specmesh.kernels.cpu import load
kernel = load()
kernel.set_num_threads(8)
x = torch.randn(1, 32)
blocked = [(n, kernel.block_weight(torch.randn(n, 32))) for n in (27 * 16, 36 * 16)]
end = time.perf_counter() + 3
while time.perf_counter() < end:
    for n, weight in blocked:  # 27 jobs, then 36
        kernel.blocked_linear(x, weight, n, torch.empty(0), None)
"""


@pytest.mark.unit
@needs_kernels
def test_regions_back_to_back_never_run_a_job_twice() -> None:
    """Eight threads on fewer cores are preempted anywhere, also in the middle of a claim
    on the region just ended while the caller opens a larger one: such a claim must fail,
    or it runs jobs of the new region twice and the caller waits for a count it never
    reaches (a hang, within seconds, before the pool closed a region first)."""
    out = subprocess.run(
        [sys.executable, "-c", BACK_TO_BACK_SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
