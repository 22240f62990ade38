"""`specmesh up`: the whole system on one machine, each service its own process.

Starts nats-server (and valkey for the Redis KV transport) on free loopback
ports unless URLs are given, then the services; waits until every instance
heartbeats and the gateway answers; prints the URL. From then on a process that
dies is restarted (services/supervision.py); Ctrl-C or SIGTERM stops everything,
services first. A process that dies while starting up stops the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import start_http_server
from specmesh.services.decode.config import DecodeConfig
from specmesh.services.drafter.config import DrafterConfig
from specmesh.services.gateway.config import GatewayConfig
from specmesh.services.learner.config import LearnerConfig, OnlineLearningConfig
from specmesh.services.prefill.config import PrefillConfig
from specmesh.services.supervision import Child, Server
from specmesh.services.tokenizer.config import TokenizerConfig
from specmesh.shared.bus import Bus, NatsAuth
from specmesh.shared.config import SGLangFlags, dataclass_argv, dataclass_secrets, option
from specmesh.shared.cores import plan_cores
from specmesh.shared.engine.engine import EngineConfig
from specmesh.shared.infra import ServerProcess, die_with_parent, start_nats, start_valkey
from specmesh.shared.protocol import HEARTBEAT, SERVICE_USERS, Heartbeat, nats_users
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.transport import DEFAULT_KV_NAMESPACE, TransportConfig

READY_TIMEOUT_S = 600  # first start-up may fetch and convert the model


@dataclass(frozen=True)
class UpConfig:
    decoders: int = option(1, "decode workers")
    drafters: int = option(1, "drafter instances (with --speculative-algorithm)")
    prefills: int = option(1, "prefill instances")
    tokenizers: int = option(1, "tokenizer instances")
    nats_url: str | None = option(
        None, "use this NATS server (or a cluster's, comma-separated) instead of starting one"
    )
    metrics: bool = option(True, "serve /metrics from every service (on free ports)")
    learner_nice: int = option(19, "niceness of the learner (--speculative-online-learning)")
    learner_idle: bool = option(
        False,
        "the learner computes only on CPU time serving leaves (SCHED_IDLE), so a serving "
        "thread that wakes never waits for it",
    )
    decode_nice: int = option(
        0,
        "niceness of decode workers (negative needs CAP_SYS_NICE); above 0 a background job "
        "at the default priority takes their cores from them",
    )


@dataclass
class Configs:
    up: UpConfig
    gateway: GatewayConfig
    engine: EngineConfig
    spec: SpeculativeConfig
    transport: TransportConfig
    decode: DecodeConfig
    prefill: PrefillConfig
    nats: NatsAuth
    sglang: SGLangFlags  # accepted for SGLang's launch commands; nothing here reads them
    tokenizer: TokenizerConfig
    online: OnlineLearningConfig
    drafter: DrafterConfig = field(init=False)
    learner: LearnerConfig = field(init=False)
    # NATS credentials of one kind of service (or the launcher), where each has its own
    nats_users: dict[str, NatsAuth] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        model, device, dtype = self.engine.model, self.engine.device, self.engine.dtype
        if self.decode.overlap and not self.spec.enabled:
            raise ValueError(
                "--overlap overlaps drafting with verification: it needs --speculative-algorithm"
            )
        self.gateway = replace(self.gateway, model=model)
        self.tokenizer = replace(self.tokenizer, model=model)
        self.drafter = DrafterConfig(model, device, dtype)
        self.learner = LearnerConfig(model, device)

    def service_configs(self, kind: str) -> list[Any]:
        own = {
            "tokenizer": [self.tokenizer],
            "prefill": [self.engine, self.spec, self.transport, self.prefill],
            "decode": [self.engine, self.spec, self.transport, self.decode],
            "drafter": [self.drafter, self.spec, self.transport],
            "learner": [self.learner, self.online, self.spec, self.transport],
            "gateway": [self.gateway],
        }[kind]
        return [self.nats_users.get(kind, self.nats), *own]

    def service_argv(self, kind: str) -> list[str]:
        return [arg for config in self.service_configs(kind) for arg in dataclass_argv(config)]

    def service_env(self, kind: str) -> dict[str, str]:
        """Secrets travel in the environment, not on the command line."""
        return {k: v for c in self.service_configs(kind) for k, v in dataclass_secrets(c).items()}


class Launcher:
    def __init__(self, configs: Configs) -> None:
        self.configs = configs
        self.servers: list[Server] = []
        self.children: dict[str, Child] = {}

    def run(self) -> int:
        try:
            return asyncio.run(self._run())
        finally:
            # Stopping takes at most ~15 s and ends in SIGKILL: a second Ctrl-C (or a
            # wrapper forwarding the first again) must not cut it short with a traceback.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            self._stop_all()

    async def _run(self) -> int:
        nats_url = self.configs.up.nats_url
        # Servers we start get secrets of this run: no other local user gets in.
        if nats_url is None:
            nats_url = self._serve_nats()
        self.configs.transport = self._transport_of_this_run(self.configs.transport)
        # a bad transport option fails here, before any model loads
        self.configs.transport.open().close()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        auth = self.configs.nats_users.get("specmesh-up", self.configs.nats)
        bus = await Bus.connect(nats_url, "specmesh-up", auth)
        seen: dict[str, str | None] = {}

        async def on_heartbeat(beat: Heartbeat) -> None:
            seen[beat.instance_id] = beat.metrics_url

        await bus.serve(HEARTBEAT.format(kind="*"), on_heartbeat)
        self._start_services(nats_url)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not set(self.children) <= set(seen):
            if stop.is_set():
                return 130
            dead = self._dead()
            if dead or time.monotonic() > deadline:
                print(f"specmesh up: {dead or 'services did not start'}; stopping", flush=True)
                return 1
            await asyncio.sleep(0.2)
        await bus.close()  # heartbeats were only needed to see everyone start
        gateway = self.configs.gateway
        lines = [f"specmesh is up: http://{gateway.host}:{gateway.port}/v1"]
        for server in self.servers:
            lines.append(f"  {server.name:<12} pid {server.server.proc.pid}  {server.server.url}")
        for instance in sorted(self.children):
            metrics = seen.get(instance) or ""
            lines.append(f"  {instance:<12} pid {self.children[instance].proc.pid}  {metrics}")
        if self.configs.up.metrics:  # restarts are counted here
            server, _ = start_http_server(0, addr="127.0.0.1")
            url = f"http://127.0.0.1:{server.server_port}/metrics"
            lines.append(f"  {'specmesh-up':<12} pid {os.getpid()}  {url}")
        # One write: the services' log lines may share this output, and must not land
        # inside a line that scripts read.
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
        while not stop.is_set():
            now = time.monotonic()
            for process in [*self.servers, *self.children.values()]:
                process.supervise(now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        return 0

    def _serve_nats(self) -> str:
        """Our own nats-server: with the user's token if one was given, else one user per
        kind of service that may use only that service's subjects."""
        nats = self.configs.nats
        if nats.nats_token:
            return self._serve("nats-server", start_nats, token=nats.nats_token).url
        passwords = {user: secrets.token_hex(24) for user in SERVICE_USERS}
        for user, password in passwords.items():
            self.configs.nats_users[user] = replace(nats, nats_user=user, nats_password=password)
        return self._serve("nats-server", start_nats, users=nats_users(passwords)).url

    def _transport_of_this_run(self, transport: TransportConfig) -> TransportConfig:
        """With the store we start, secrets of this run and a namespace of its own."""
        if transport.kv_transport == "redis" and transport.redis_url is None:
            password = transport.redis_password or secrets.token_hex(24)
            url = self._serve("valkey", start_valkey, password=password).url
            transport = replace(transport, redis_password=password, redis_url=url)
        if transport.kv_transport == "direct":  # the prefills' block servers
            secret = transport.kv_direct_secret or secrets.token_hex(24)
            transport = replace(transport, kv_direct_secret=secret)
        if transport.kv_namespace == DEFAULT_KV_NAMESPACE:
            # Deployments on one host must not share (or clean up) each other's blocks.
            namespace = f"{DEFAULT_KV_NAMESPACE}-{self.configs.gateway.port}"
            transport = replace(transport, kv_namespace=namespace)
        return transport

    def _serve(
        self, name: str, start: Callable[..., ServerProcess], **options: Any
    ) -> ServerProcess:
        """Start a server we supervise; a restart takes the same port (clients keep the URL)."""
        server = start(**options)
        port = urlsplit(server.url).port
        launch = functools.partial(start, port, **options)
        self.servers.append(Server(name, name, time.monotonic(), launch=launch, server=server))
        return server

    def _start_services(self, nats_url: str) -> None:
        up = self.configs.up
        counts = {
            "tokenizer": up.tokenizers,
            "prefill": up.prefills,
            "decode": up.decoders,
            "drafter": up.drafters if self.configs.spec.enabled else 0,
            "learner": int(self.configs.spec.speculative_online_learning),
            "gateway": 1,
        }
        # Each instance's cores, threads and priority; a child dies with us.
        priority = {
            "decode": {"nice": up.decode_nice},
            "learner": {"nice": up.learner_nice, "idle": up.learner_idle},
        }
        cores = plan_cores(sorted(os.sched_getaffinity(0)), counts)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for kind, count in counts.items():
            for i in range(count):
                instance = f"{kind}-{i}"
                placement = cores[instance]
                placement = replace(placement, **priority.get(kind, {}))
                argv = [sys.executable, "-m", f"specmesh.services.{kind}", "--nats-url", nats_url]
                argv += ["--instance-id", instance, *self.configs.service_argv(kind)]
                argv += dataclass_argv(placement)
                if up.metrics and kind != "gateway":  # the gateway serves /metrics itself
                    argv += ["--metrics-port", "0"]
                child = Child(
                    instance,
                    kind,
                    argv=argv,
                    env={**env, **self.configs.service_env(kind)},
                    preexec_fn=die_with_parent(),
                )
                child.start()
                self.children[instance] = child

    def _dead(self) -> str | None:
        for instance, child in self.children.items():
            code = child.poll()
            if code is not None:
                return f"{instance} exited with code {code}"
        return None

    def _stop_all(self) -> None:
        procs = [c.proc for c in self.children.values() if c.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 15
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for server in reversed(self.servers):
            if server.server is not None:
                server.server.stop()
        transport = self.configs.transport
        if transport.kv_transport == "shm":
            from specmesh.shared.transport.shm import ShmTransport

            ShmTransport(transport.kv_namespace).remove_all()
