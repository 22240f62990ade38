"""specmesh over a 3-node NATS cluster: `--nats-url` takes the nodes comma-separated, each
service connects to one of them at random and fails over to the others. One node killed
mid-stream costs no request anything."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from deployment import GREEDY, PROMPTS, Deployment, chat_text, fault_mid_stream, specmesh_up
from nats.aio.msg import Msg
from specmesh.shared.bus import Bus
from specmesh.shared.infra import ServerProcess, cluster_urls, start_nats_cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[ServerProcess]]:
    with start_nats_cluster(3) as nodes:
        yield nodes


def test_a_bus_reaches_the_cluster_past_a_dead_node(cluster: list[ServerProcess]) -> None:
    """A message published through one node reaches a subscriber on another; a list whose
    first server is down still connects; a list of only dead servers names each."""

    async def main() -> None:
        first = await Bus.connect(cluster[0].url, "first")
        second = await Bus.connect(cluster[1].url, "second")
        got: asyncio.Queue[bytes] = asyncio.Queue()

        async def received(msg: Msg) -> None:
            got.put_nowait(msg.data)

        sub = await second.nc.subscribe("probe", cb=received)
        await second.nc.flush()
        for _ in range(50):  # until the subscription has crossed the route to `first`'s node
            await first.nc.publish("probe", b"across")
            with contextlib.suppress(TimeoutError):
                assert await asyncio.wait_for(got.get(), 0.1) == b"across"
                break
        else:
            raise AssertionError("nothing crossed between the nodes")
        await sub.unsubscribe()
        dead = "nats://127.0.0.1:1"
        listed = await Bus.connect(f"{dead},{cluster[2].url}", "listed")
        assert listed.nc.is_connected
        with pytest.raises(ConnectionError, match=r"nats://127.0.0.1:1: .*nats://127.0.0.1:2"):
            await Bus.connect(f"{dead},nats://127.0.0.1:2", "none")
        for bus in (first, second, listed):
            await bus.nc.close()

    asyncio.run(main())


def test_a_killed_nats_node_costs_no_request_anything(
    cluster: list[ServerProcess], smollm_dir: Path, tmp_path: Path
) -> None:
    """8 greedy streams over the cluster, SIGKILL of one node once all have output: the
    services on it reconnect to another and every stream ends with the text it would have
    had; new requests are served after."""
    url_list, log = cluster_urls(cluster), tmp_path / "up.log"
    up = ("--nats-url", url_list, "--decoders", "2", "--speculative-algorithm", "NGRAM")
    with specmesh_up(smollm_dir, *up, log=log) as url:
        reference = [chat_text(url, p, **GREEDY) for p in PROMPTS]
        d = Deployment(url, log, cluster[0])
        results, seconds = fault_mid_stream(d.url, PROMPTS * 2, cluster[0].proc.kill, GREEDY)
        assert results == [(text, {}) for text in reference * 2]
        assert seconds < 30
        assert [chat_text(url, p, **GREEDY) for p in PROMPTS] == reference
