"""The five services as separate processes over real NATS and a real KV store.

Each deployment gets its own nats-server (so deployments never see each other)
and `specmesh up` pointed at it. Greedy output over HTTP must equal the
in-process engine's, token for token, whatever the placement.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from deployment import (
    CHAT_GREEDY,
    CHATS,
    chat,
    chat_text,
    heartbeats,
    sample,
    scrape,
    specmesh_up,
    stream_chat,
    streamed_text,
)
from helpers import tiny_llama
from otlp_receiver import OtlpReceiver
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.infra import ServerProcess, start_nats, start_valkey
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.speculative.config import shipped_drafter
from specmesh.shared.tokenizer import Tokenizer

SERVICES = {"gateway", "tokenizer", "prefill", "decode", "drafter"}


@pytest.fixture(scope="module")
def valkey() -> Iterator[ServerProcess]:
    with start_valkey() as server:
        yield server


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def ngram_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the `ngram` deployment writes: the launcher's output and every service's logs."""
    return tmp_path_factory.mktemp("ngram") / "up.log"


@pytest.fixture(scope="module")
def ngram(
    smollm_dir: Path, valkey: ServerProcess, receiver: OtlpReceiver, ngram_log: Path
) -> Iterator[tuple[str, str]]:
    """NGRAM, Redis KV transport, no overlap, spans to the receiver: (HTTP url, NATS url)."""
    args = ["--speculative-algorithm", "NGRAM", "--kv-transport", "redis"]
    args += ["--redis-url", valkey.url, "--kv-namespace", "ngram-test", "--no-overlap"]
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    with (
        start_nats() as bus,
        specmesh_up(smollm_dir, "--nats-url", bus.url, *args, env=env, log=ngram_log) as url,
    ):
        yield url, bus.url


@pytest.fixture(scope="module")
def standalone(
    smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, Path]]:
    """STANDALONE (a random draft model), direct KV transport (decode pulls from prefill),
    overlap on, 2 decoders and 2 drafters: (HTTP url, NATS url, launcher output)."""
    draft = tiny_llama(tmp_path_factory.mktemp("draft"), vocab=49152, seed=0)
    log = tmp_path_factory.mktemp("up") / "up.log"
    args = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft]
    args += ["--decoders", "2", "--drafters", "2", "--kv-transport", "direct", "--overlap"]
    with (
        start_nats() as bus,
        specmesh_up(smollm_dir, "--nats-url", bus.url, *args, log=log) as url,
    ):
        yield url, bus.url, log


def test_ngram_pipeline_equals_the_in_process_engine(
    ngram: tuple[str, str], chat_reference: dict[str, str]
) -> None:
    url, _ = ngram
    for prompt in CHATS:
        assert chat_text(url, prompt, **CHAT_GREEDY) == chat_reference[prompt]
        assert streamed_text(stream_chat(url, prompt, **CHAT_GREEDY)) == chat_reference[prompt]
    state = httpx.get(f"{url}/get_server_info").json()["internal_states"][0]
    assert state["speculative_algorithm"] == "NGRAM" and state["avg_spec_accept_length"] > 1.0


# What SGLang's published Grafana dashboard queries (sgl-project/sglang,
# examples/monitoring/grafana/dashboards/json/sglang-dashboard.json): latency histograms and
# scheduler gauges, filtered by `model_name` (`instance` is Prometheus's own label).
SGLANG_DASHBOARD_SERIES = [
    *(
        f"sglang:{h}_{part}"
        for h in ("e2e_request_latency_seconds", "time_to_first_token_seconds")
        for part in ("bucket", "sum", "count")
    ),
    "sglang:num_running_reqs",
    "sglang:gen_throughput",
    "sglang:cache_hit_rate",
    "sglang:num_queue_reqs",
]


def _all_samples(url: str, nats_url: str) -> dict:
    samples = scrape(f"{url}/metrics")
    for beat in heartbeats(nats_url).values():
        if beat.metrics_url:
            samples |= scrape(beat.metrics_url)
    return samples


def test_sglang_dashboard_series_are_served(ngram: tuple[str, str], smollm_dir: Path) -> None:
    url, nats_url = ngram
    chat_text(url, CHATS[0], **CHAT_GREEDY)
    model = {("model_name", smollm_dir.name)}
    deadline = time.monotonic() + 15  # gauges are set with each heartbeat, rates from the second
    while True:
        samples = _all_samples(url, nats_url)
        served = {name for name, labels in samples if model <= set(labels)}
        missing = [name for name in SGLANG_DASHBOARD_SERIES if name not in served]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, missing
    assert not [key for key in samples if "instance" in dict(key[1])]
    finished = [
        v
        for (name, labels), v in samples.items()
        if name.endswith("e2e_request_latency_seconds_count")
    ]
    assert sum(finished) >= 1


def test_an_sglang_launch_command_starts_us_unchanged(smollm_dir: Path) -> None:
    """SGLang's EAGLE-3 example (docs/advanced_features/speculative_decoding), its model and
    draft paths aside: GPU-only flags are accepted, `--mem-fraction` abbreviated as there."""
    head = shipped_drafter(str(smollm_dir), "EAGLE3")
    sglang = (
        f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {head} "
        "--speculative-num-steps 5 --speculative-eagle-topk 8 --speculative-num-draft-tokens 32 "
        "--mem-fraction 0.6 --cuda-graph-max-bs 2 --dtype float16 --log-level warning"
    )
    with (
        start_nats() as bus,
        specmesh_up(smollm_dir, "--nats-url", bus.url, *sglang.split()) as up,
    ):
        assert chat_text(up, CHATS[0], temperature=0, max_tokens=8)
        state = httpx.get(f"{up}/get_server_info").json()["internal_states"][0]
        assert state["speculative_algorithm"] == "EAGLE3"


def test_kv_blocks_travel_through_redis(ngram: tuple[str, str], valkey: ServerProcess) -> None:
    url, nats_url = ngram
    chat_text(url, "Name three colours.", **CHAT_GREEDY)
    metrics = {
        b.kind: scrape(b.metrics_url) for b in heartbeats(nats_url).values() if b.metrics_url
    }
    written = sample(
        metrics["prefill"], "specmesh_kv_transport_bytes_total", **_kv("prefill", "write")
    )
    read = sample(metrics["decode"], "specmesh_kv_transport_bytes_total", **_kv("decode", "read"))
    assert written > 0 and read > 0
    keys = redis.Redis.from_url(valkey.url).keys("ngram-test:*")
    assert keys, "no KV blocks in the store"


def _kv(service: str, direction: str) -> dict[str, str]:
    return {"service": service, "direction": direction}


def test_shared_prefix_is_computed_once(ngram: tuple[str, str], smollm_dir: Path) -> None:
    url, nats_url = ngram
    tok = Tokenizer(smollm_dir)
    document = " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(80))
    assert len(tok.encode(document)) > 600
    (prefill,) = [b for b in heartbeats(nats_url).values() if b.kind == "prefill"]
    before = scrape(prefill.metrics_url)
    bodies = [
        chat(url, f"{document}\nQuestion {q}: what colour is item {q}?", **CHAT_GREEDY).json()
        for q in (7, 8)
    ]
    after = scrape(prefill.metrics_url)
    computed = [
        sample(m, "specmesh_prefill_tokens_total", source="computed") for m in (before, after)
    ]
    first, second = (b["usage"] for b in bodies)
    new = [
        u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in (first, second)
    ]
    assert second["prompt_tokens_details"]["cached_tokens"] >= 512 and new[1] < 64
    # Prefill computed the first prompt whole; the second's tail was computed once, by
    # prefill or by the decode worker (KV-aware routing: its prefix cache holds the rest).
    assert computed[1] - computed[0] in (new[0], new[0] + new[1])


def test_plan_sizes_the_pools_from_live_load(ngram: tuple[str, str]) -> None:
    url, nats_url = ngram
    argv = [
        sys.executable,
        "-m",
        "specmesh.services.cli",
        "plan",
        "--nats-url",
        nats_url,
        "--window",
        "4",
    ]
    with ThreadPoolExecutor(2) as pool:
        planning = pool.submit(subprocess.run, argv, capture_output=True, text=True, timeout=120)
        while not planning.done():
            chat_text(url, "Count from one to twenty in words.", **CHAT_GREEDY)
    result = planning.result()
    assert result.returncode == 0, result.stderr
    decode = re.search(
        r"decode workers +1 now, (\d+)% busy, step ([\d.]+) ms -> (\d+)", result.stdout
    )
    assert decode is not None, result.stdout
    assert int(decode[1]) > 0 and float(decode[2]) > 0 and int(decode[3]) >= 1
    assert re.search(r"drafters +1 now, \d+% busy", result.stdout)
    assert "-var decode_count=" in result.stdout


def test_one_trace_covers_all_five_services(ngram: tuple[str, str], receiver: OtlpReceiver) -> None:
    url, _ = ngram
    response = chat(url, "Say hello.", **CHAT_GREEDY)
    request_id = response.headers["x-request-id"]
    assert response.json()["id"] == request_id

    def services_in_trace(spans: list) -> set[str]:
        roots = [s for s in spans if s.attributes.get("specmesh.request_id") == request_id]
        if not roots:
            return set()
        trace_id = roots[0].trace_id
        return {s.service.removeprefix("specmesh-") for s in spans if s.trace_id == trace_id}

    spans = receiver.wait_for(lambda spans: services_in_trace(spans) >= SERVICES, timeout=20)
    # The id sits on one span, the gateway's: search the traces by it.
    (tagged,) = [s for s in spans if s.attributes.get("specmesh.request_id") == request_id]
    assert tagged.service == "specmesh-gateway"


def test_two_decoders_two_drafters_under_concurrency(
    standalone: tuple[str, str, Path], chat_reference: dict[str, str]
) -> None:
    url, nats_url, log = standalone
    launched = log.read_text()
    for instance in ("decode-0", "decode-1", "drafter-0", "drafter-1"):
        assert instance in launched  # `specmesh up` lists every process it started
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda p: chat_text(url, p, **CHAT_GREEDY), CHATS))
    assert texts == [chat_reference[p] for p in CHATS]
    streamed = streamed_text(stream_chat(url, CHATS[2], **CHAT_GREEDY))
    assert streamed == chat_reference[CHATS[2]]
    gateway = scrape(f"{url}/metrics")
    for kind in ("decode", "drafter"):
        for i in (0, 1):
            routed = sample(
                gateway, "specmesh_routed_requests_total", kind=kind, instance_id=f"{kind}-{i}"
            )
            assert routed >= 2, f"{kind}-{i} got {routed} requests"
    for beat in heartbeats(nats_url).values():
        if beat.kind == "decode":  # both verified drafts, both pulled KV blocks from prefill
            metrics = scrape(beat.metrics_url)
            assert sample(metrics, "specmesh_spec_verify_steps_total", algorithm="STANDALONE")
            assert sample(metrics, "specmesh_kv_transport_bytes_total", **_kv("decode", "read"))


def test_a_conversations_next_turn_is_computed_where_its_last_ran(
    standalone: tuple[str, str, Path], smollm_dir: Path
) -> None:
    """KV-aware routing: the second turn goes to the decode worker whose prefix cache holds
    the first turn and its answer, which computes only the new message (no store holds the
    answer's K/V); the text is the in-process engine's."""
    url, _, _ = standalone
    messages = [{"role": "user", "content": "Describe a lighthouse in three sentences."}]
    usage = []
    for follow_up in ("Now describe its keeper.", None):
        body = {"messages": messages, **CHAT_GREEDY, "max_tokens": 48}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()
        usage.append(reply["usage"])
        text = reply["choices"][0]["message"]["content"]
        if follow_up is not None:
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": follow_up},
            ]
    assert usage[1]["prompt_tokens_details"]["cached_tokens"] > usage[0]["prompt_tokens"]
    tok = Tokenizer(smollm_dir)
    engine = LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.25))
    [expected] = engine.generate(
        [tok.encode_chat(messages)], SamplingParams(temperature=0.0, max_tokens=48)
    )
    assert text == tok.decode(expected)


def _start_instance(kind: str, nats_url: str, instance: str, *args: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", f"specmesh.services.{kind}", "--nats-url", nats_url]
    return subprocess.Popen([*argv, "--instance-id", instance, *args])


def _wait_for_instances(url: str, kind: str, count: int, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        state = httpx.get(f"{url}/get_server_info").json()["internal_states"][0]
        if state["instances"][kind] == count:
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"the gateway did not see {count} {kind} instances in {timeout} s")


def test_instances_join_and_leave_at_run_time(
    standalone: tuple[str, str, Path], smollm_dir: Path, chat_reference: dict[str, str]
) -> None:
    url, nats_url, _ = standalone
    draft = ["--speculative-algorithm", "NGRAM"]
    joined = _start_instance("drafter", nats_url, "drafter-extra", *draft)
    decode_args = ["--model", str(smollm_dir), "--kv-cache-gb", "0.1"]
    # Without the deployment's secret: the prompts it gets are computed here, not pulled.
    decode_args += ["--kv-transport", "direct", "--speculative-algorithm", "STANDALONE"]
    decode_args += ["--speculative-draft-model-path", str(smollm_dir)]
    extra_decode = _start_instance("decode", nats_url, "decode-extra", *decode_args)
    try:
        _wait_for_instances(url, "drafter", 3, timeout=60)
        _wait_for_instances(url, "decode", 3, timeout=120)
        joined.send_signal(signal.SIGKILL)  # gone without a goodbye: noticed by silence
        assert _wait_for_instances(url, "drafter", 2, timeout=10) < 6
        extra_decode.send_signal(signal.SIGTERM)  # a clean exit says goodbye
        assert _wait_for_instances(url, "decode", 2, timeout=10) < 3
        assert extra_decode.wait(timeout=30) == 0
    finally:
        for proc in (joined, extra_decode):
            proc.kill()
            proc.wait()
    assert chat_text(url, CHATS[1], **CHAT_GREEDY) == chat_reference[CHATS[1]]


def test_bad_instance_flags_fail_clearly() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "specmesh.services.drafter", "--nats-url", "nats://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "needs --speculative-algorithm" in result.stderr


def test_the_gateway_logs_each_request_with_its_ids(
    ngram: tuple[str, str], ngram_log: Path, receiver: OtlpReceiver
) -> None:
    """One access line per request, carrying the request id the response names and the trace
    id of the request's spans, whose root is the request's HTTP span."""
    url, _ = ngram
    request_id = chat(url, "Say hi.", **CHAT_GREEDY).headers["x-request-id"]

    def roots(spans: list) -> list:
        """The request's root span, once received (it ends after its access line is written)."""
        tagged = [s for s in spans if s.attributes.get("specmesh.request_id") == request_id]
        trace_ids = {s.trace_id for s in tagged}
        return [s for s in spans if s.trace_id in trace_ids and not s.parent_span_id]

    (root,) = roots(receiver.wait_for(lambda spans: bool(roots(spans)), timeout=20))
    assert (root.service, root.name) == ("specmesh-gateway", "POST /v1/chat/completions")
    log = ngram_log.read_text().splitlines()
    lines = [line for line in log if "specmesh.access" in line and request_id in line]
    assert len(lines) == 1, lines
    access = r"gateway-0 INFO specmesh\.access: POST /v1/chat/completions 200 [\d.]+ ms"
    assert re.search(rf"{access} request_id={request_id} trace_id={root.trace_id}$", lines[0])
