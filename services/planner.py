"""`specmesh plan`: how many decode workers and drafters the live load needs.

It finds the instances by their heartbeats, scrapes each decode worker's and drafter's
/metrics at the start and the end of `--window` seconds, and sizes each pool for
`--target-utilization` u:

    decode workers = ceil(sum_i (step_i + wait_i) / (window * u))
    drafters       = ceil(sum_j draft_j / (window * u))

where step_i is the time decode worker i spent in forward steps over the window
(`specmesh_verify_seconds_sum`), wait_i the time it waited for drafts
(`specmesh_draft_wait_seconds`), and draft_j the time drafter j spent drafting
(`specmesh_draft_seconds_sum`). A worker that ends the window with requests queued counts
as busy the whole window. Each pool keeps at least one instance while it has one. Also
shown: the acceptance length and the mean verify and draft step times behind the numbers.
The Nomad job takes the result as `-var decode_count=N -var drafter_count=M`.
"""

from __future__ import annotations

import asyncio
import math
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from specmesh.shared.bus import Bus, NatsAuth
from specmesh.shared.config import option
from specmesh.shared.protocol import HEARTBEAT, Heartbeat

HEARTBEAT_WAIT_S = 2.5  # every live instance heartbeats within this (1 s interval)
Samples = dict[str, float]  # sample name -> value, summed over label sets


@dataclass(frozen=True)
class PlanConfig:
    nats_url: str = option("nats://127.0.0.1:4222", "NATS server(s), comma-separated")
    window: float = option(30.0, "seconds of live load to measure")
    target_utilization: float = option(
        0.8, "the share of its time each decode worker and drafter should be busy"
    )


@dataclass
class PoolUse:
    instances: int
    busy_seconds: float  # summed over the pool's instances, over the window
    step_seconds: float  # the mean time of one step (verify or draft)


@dataclass
class Plan:
    decode: PoolUse
    drafter: PoolUse
    acceptance_length: float | None
    decode_needed: int
    drafters_needed: int

    def nomad_vars(self) -> str:
        return f"-var decode_count={self.decode_needed} -var drafter_count={self.drafters_needed}"


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name] = samples.get(s.name, 0.0) + s.value
    return samples


def delta(before: Samples, after: Samples, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def pool_use(pairs: Iterable[tuple[Samples, Samples]], kind: str, window: float) -> PoolUse:
    """`pairs`: each instance's samples at the window's start and end."""
    metric = "specmesh_verify_seconds" if kind == "decode" else "specmesh_draft_seconds"
    pairs = list(pairs)
    busy = steps = seconds = 0.0
    for before, after in pairs:
        spent = delta(before, after, f"{metric}_sum")
        steps += delta(before, after, f"{metric}_count")
        seconds += spent
        if kind == "decode":
            spent += delta(before, after, "specmesh_draft_wait_seconds_total")
            if after.get("sglang:num_queue_reqs", 0.0) > 0:
                spent = window
        busy += min(spent, window)
    return PoolUse(len(pairs), busy, seconds / steps if steps else 0.0)


def needed(use: PoolUse, window: float, utilization: float) -> int:
    if not use.instances:
        return 0
    return max(1, math.ceil(use.busy_seconds / (window * utilization) - 1e-9))


def plan(
    decode: list[tuple[Samples, Samples]],
    drafters: list[tuple[Samples, Samples]],
    window: float,
    utilization: float,
) -> Plan:
    decode_use = pool_use(decode, "decode", window)
    drafter_use = pool_use(drafters, "drafter", window)
    verified = sum(delta(b, a, "specmesh_spec_verify_steps_total") for b, a in decode)
    accepted = sum(delta(b, a, "specmesh_spec_accepted_tokens_total") for b, a in decode)
    return Plan(
        decode=decode_use,
        drafter=drafter_use,
        acceptance_length=1 + accepted / verified if verified else None,
        decode_needed=needed(decode_use, window, utilization),
        drafters_needed=needed(drafter_use, window, utilization),
    )


async def heartbeats(cfg: PlanConfig, auth: NatsAuth) -> list[Heartbeat]:
    bus = await Bus.connect(cfg.nats_url, "specmesh-plan", auth)
    seen: dict[str, Heartbeat] = {}

    async def on_heartbeat(beat: Heartbeat) -> None:
        seen[beat.instance_id] = beat

    await bus.serve(HEARTBEAT.format(kind="*"), on_heartbeat)
    await asyncio.sleep(HEARTBEAT_WAIT_S)
    await bus.close()
    return [b for b in seen.values() if not b.leaving]


def measure(cfg: PlanConfig, auth: NatsAuth) -> Plan:
    if cfg.window <= 0 or not 0 < cfg.target_utilization <= 1:
        raise ValueError("--window must be > 0 and --target-utilization in (0, 1]")
    beats = asyncio.run(heartbeats(cfg, auth))
    urls = {
        kind: [b.metrics_url for b in beats if b.kind == kind and b.metrics_url]
        for kind in ("decode", "drafter")
    }
    if not urls["decode"]:
        raise ValueError(f"no decode worker with metrics heartbeats on {cfg.nats_url}")
    before = {url: scrape(url) for kind in urls.values() for url in kind}
    time.sleep(cfg.window)
    pairs = {kind: [(before[u], scrape(u)) for u in kind_urls] for kind, kind_urls in urls.items()}
    return plan(pairs["decode"], pairs["drafter"], cfg.window, cfg.target_utilization)


def report(p: Plan, cfg: PlanConfig) -> str:
    lines = [f"over {cfg.window:g} s, sized for {cfg.target_utilization:.0%} busy:"]
    for name, use, need in (
        ("decode workers", p.decode, p.decode_needed),
        ("drafters", p.drafter, p.drafters_needed),
    ):
        share = use.busy_seconds / (cfg.window * use.instances) if use.instances else 0.0
        lines.append(
            f"  {name:<15} {use.instances} now, {share:.0%} busy, step "
            f"{use.step_seconds * 1000:.1f} ms -> {need}"
        )
    if p.acceptance_length is not None:
        lines.append(f"  acceptance length {p.acceptance_length:.2f}")
    lines.append(f"nomad job run {p.nomad_vars()} deploy/nomad/specmesh.nomad.hcl")
    return "\n".join(lines)
