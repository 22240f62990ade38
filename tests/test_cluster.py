"""scripts/cluster (issue 34): the many-host topology (network namespaces on a bridge, a
3-node NATS cluster, valkey, one host per service instance) comes up from the repo as from
a fresh clone; greedy chats through it are transformers' own greedy output; a decode host
and a drafter host partitioned, a NATS node killed and valkey restarted, one at a time
under 8 streams, fail or change none; `down` leaves no namespace, link or process
behind."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest.mock import ANY

import pytest
import torch
from cluster_faults import STREAMS, strike_each
from deployment import GREEDY, chat_text
from specmesh.services.cluster_harness import netns
from specmesh.services.cluster_harness.errors import ClusterError
from specmesh.services.cluster_harness.state import STATE_DIR
from specmesh.services.cluster_harness.topology import PREFIX, all_hosts
from specmesh.shared.infra import free_port
from specmesh.shared.tokenizer import Tokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cluster"
PROMPTS = [
    "What is the capital of France?",
    "List the days of the week.",
    "Name the planets of the solar system.",
    "Count from one to ten in words.",
    "Spell the word 'banana' letter by letter.",
    "Write a haiku about autumn leaves.",
    "Give two reasons to learn Rust.",
    "What is 12 times 12?",
    "Name three primary colors.",
    "Translate 'good morning' into Spanish.",
    "What does a thermometer measure?",
    "Name four animals that live in the ocean.",
    "What is the boiling point of water in Celsius?",
    "Describe a cat in one sentence.",
    "List the months of the year.",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet?",
    "Give a synonym for 'happy'.",
    "Name three fruits that are red.",
    "What is the opposite of 'cold'?",
]
MAX_TOKENS = 24


def _cluster(*args: str, output: Path) -> subprocess.Popen[bytes]:
    """`scripts/cluster <args>` running, what it prints going to `output`."""
    # SPECMESH_* reach every service, as in compose: a small KV cache per engine host
    env = {**os.environ, "SPECMESH_KV_CACHE_GB": "0.25"}
    with open(output, "wb") as out:
        return subprocess.Popen([SCRIPT, *args], stdout=out, stderr=subprocess.STDOUT, env=env)


def _run(*args: str, output: Path, timeout: float) -> str:
    """What `scripts/cluster <args>` printed; it must succeed."""
    proc = _cluster(*args, output=output)
    proc.wait(timeout)
    assert proc.returncode == 0, output.read_text()
    return output.read_text()


def _transformers_greedy(model_dir: Path) -> list[str]:
    from transformers import AutoModelForCausalLM

    tok = Tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok.encode_chat([{"role": "user", "content": prompt}])
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
            texts.append(tok.decode(out[0, len(ids) :].tolist()))
    return texts


def test_the_cluster_serves_transformers_greedy_output_and_leaves_nothing_behind(
    smollm_dir: Path, tmp_path: Path
) -> None:
    try:
        netns.check_namespaces()
    except ClusterError as exc:
        pytest.skip(f"no network namespaces here: {exc}")
    if netns.our_namespaces() or STATE_DIR.exists():
        pytest.fail("a scripts/cluster topology is already up here; `scripts/cluster down` first")
    port = free_port()
    up_log = tmp_path / "up.log"
    # valkey carries the K/V: one of the faults restarts it
    up = _cluster("up", "--port", str(port), "--kv-transport", "redis", output=up_log)
    try:
        # while the hosts start: the two share the cores sooner than one after the other
        reference = _transformers_greedy(smollm_dir)
        assert up.wait(240) == 0, up_log.read_text()
        url = f"http://127.0.0.1:{port}"

        def greedy(prompt: str) -> str:
            return chat_text(url, prompt, temperature=0, max_tokens=MAX_TOKENS)

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(greedy, PROMPTS)) == reference
        # Faults between hosts under 8 streams: none may fail or change a stream.
        no_fault = [chat_text(url, p, **GREEDY) for p in STREAMS]
        for name, failed, _ in strike_each(url, no_fault):
            assert not failed, f"{name}: {failed}"
        listed = _run("hosts", output=tmp_path / "hosts.txt", timeout=60)
        # host, address, what runs, its state, the NATS node a service is connected to
        rows = {line.split()[0]: line.split() for line in listed.splitlines()[1:]}
        for host in all_hosts():
            assert rows[host.name][1:4] == [host.address, ANY, "running"], listed
            if host.role not in ("nats", "valkey"):
                assert rows[host.name][4].startswith("nats-"), listed
    finally:
        if up.poll() is None:  # failed before it was up: `down` removes what it made
            up.kill()
            up.wait()
        if STATE_DIR.exists():  # the hosts' logs, for a failure's report
            shutil.copytree(STATE_DIR, tmp_path / "cluster", dirs_exist_ok=True)
        _run("down", output=tmp_path / "down.log", timeout=120)
    assert netns.our_namespaces() == []
    assert PREFIX not in netns.ip("-br", "link")
    assert not STATE_DIR.exists()
