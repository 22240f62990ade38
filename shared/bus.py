"""The NATS bus every service talks through: typed messages, deadlines, trace context.

Requests carry the caller's W3C trace context in NATS headers; a served
handler runs inside a span continuing it, so one trace follows a request
through every service. Handlers of one subscription run one at a time, in
arrival order (the detokenizer relies on it).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoServersError
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from specmesh.shared.config import nats_servers, option, secret_option
from specmesh.shared.protocol import (
    ErrorReply,
    PayloadTooLarge,
    ProtocolError,
    RemoteError,
    inbox_prefix,
    pack,
    unpack,
)

log = logging.getLogger(__name__)
tracer = trace.get_tracer("specmesh.bus")

M = TypeVar("M")
Handler = Callable[[Any], Awaitable[Any]]


class BusError(RuntimeError):
    """No answer in time, or nobody serves the subject."""


class NoResponders(BusError):
    """Nobody serves the subject (right now)."""


@dataclass(frozen=True)
class NatsAuth:
    """How a process proves who it is to NATS and encrypts the connection (all optional;
    a `tls://` URL turns TLS on with the system's CAs)."""

    nats_user: str | None = option(None, "NATS user (with --nats-password)")
    nats_password: str | None = secret_option("NATS password")
    nats_token: str | None = secret_option("NATS authentication token")
    nats_creds: str | None = option(None, "NATS credentials file (user JWT and NKey seed)")
    nats_tls_ca: str | None = option(None, "CA file to verify the NATS server by (turns TLS on)")
    nats_tls_cert: str | None = option(None, "client certificate for NATS mutual TLS")
    nats_tls_key: str | None = option(None, "client certificate's key for NATS mutual TLS")

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for `nats.connect`."""
        options: dict[str, Any] = {}
        if self.nats_user:
            options.update(user=self.nats_user, password=self.nats_password)
        if self.nats_token:
            options["token"] = self.nats_token
        if self.nats_creds:
            options["user_credentials"] = self.nats_creds
        if self.nats_tls_key and not self.nats_tls_cert:
            raise ValueError("--nats-tls-key needs --nats-tls-cert")
        if self.nats_tls_ca or self.nats_tls_cert:
            try:
                context = ssl.create_default_context(cafile=self.nats_tls_ca)
                if self.nats_tls_cert:
                    context.load_cert_chain(self.nats_tls_cert, self.nats_tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"NATS TLS files: {exc}") from exc
            options["tls"] = context
        return options


def _headers(ctx: otel_context.Context | None) -> dict[str, str]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


async def _log_error(error: Exception) -> None:
    """One line per connection error (a dead node of the list, a lost connection), not
    nats-py's traceback."""
    log.warning("NATS: %r", error)


async def _quiet(error: Exception) -> None:
    """The probe's failures are reported together, not as a traceback per attempt."""


async def _probe(servers: list[str], options: dict[str, Any]) -> None:
    """One plain connect to each server in turn until one takes it: a client that reconnects
    forever also retries its first connect forever, so a wrong URL or password would hang.
    Raises with every server's error when none does."""
    errors = []
    for server in servers:
        try:
            # nats-py retries a refused connect even without reconnects (60 times, 2 s
            # apart, by default): once more, at once, is enough here
            probe = await nats.connect(
                server,
                connect_timeout=5,
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0,
                error_cb=_quiet,
                **options,
            )
        except Exception as exc:
            reason = "nothing answers there" if isinstance(exc, NoServersError) else str(exc)
            errors.append(f"{server}: {reason}" if len(servers) > 1 else reason)
            continue
        await probe.close()
        return
    raise ConnectionError("; ".join(errors) or "no server given")


class Bus:
    def __init__(self, nc: Client, name: str) -> None:
        self.nc = nc
        self.name = name
        self._subscriptions: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(cls, url: str, name: str, auth: NatsAuth | None = None) -> Bus:
        """`url`: one server, or a cluster's as a comma-separated list (the client picks one
        at random and fails over to the others)."""
        auth = auth or NatsAuth()
        options = auth.connect_options()
        if auth.nats_user:  # replies come back where only this user may subscribe
            options["inbox_prefix"] = inbox_prefix(auth.nats_user)
        servers = nats_servers(url)
        try:
            await _probe(servers, options)
            nc = await nats.connect(
                servers,
                name=name,
                connect_timeout=5,
                max_reconnect_attempts=-1,
                allow_reconnect=True,
                error_cb=_log_error,
                **options,
            )
        except Exception as exc:
            raise ConnectionError(f"cannot reach NATS at {url}: {exc}") from exc
        return cls(nc, name)

    async def request(
        self,
        subject: str,
        msg: Any,
        expect: type[M],
        timeout: float,
        ctx: otel_context.Context | None = None,
    ) -> M:
        """Send and wait for the reply. RemoteError if the peer failed, BusError if none."""
        with tracer.start_as_current_span(
            f"request {subject}", context=ctx, kind=trace.SpanKind.CLIENT
        ):
            data = self._encoded(msg)
            try:
                reply = await self.nc.request(subject, data, timeout, headers=_headers(None))
            except nats.errors.NoRespondersError as exc:
                raise NoResponders(f"no service answers on {subject}") from exc
            except nats.errors.TimeoutError as exc:
                raise BusError(f"no reply on {subject} within {timeout} s") from exc
            except nats.errors.Error as exc:  # reconnecting with a full buffer, closed, ...
                raise BusError(f"cannot send on {subject}: {exc}") from exc
            return unpack(reply.data, expect)

    async def publish(
        self, subject: str, msg: Any, ctx: otel_context.Context | None = None
    ) -> None:
        await self.nc.publish(subject, self._encoded(msg), headers=_headers(ctx))

    def _encoded(self, msg: Any) -> bytes:
        """`msg` encoded; PayloadTooLarge if NATS would refuse it (the server's limit)."""
        data = pack(msg)
        if len(data) > self.nc.max_payload:
            name, limit = type(msg).__name__, self.nc.max_payload
            raise PayloadTooLarge(f"{name} of {len(data)} bytes is over the bus's {limit}")
        return data

    async def serve(
        self, subject: str, handler: Handler, queue: str = "", concurrent: bool = False
    ) -> None:
        """Run `handler(message)` for each message on `subject`; a returned message is the
        reply. A failing handler answers ErrorReply (400 for ValueError, else 500).
        Messages are handled one at a time in order, or each in its own task if
        `concurrent` (for handlers that wait on other work)."""

        async def handle(raw: Msg) -> None:
            ctx = propagate.extract(raw.headers or {})
            with tracer.start_as_current_span(
                f"{self.name} {subject}", context=ctx, kind=trace.SpanKind.SERVER
            ):
                try:
                    reply = await handler(unpack(raw.data))
                except ProtocolError as exc:
                    reply = ErrorReply(message=str(exc), status=exc.status)
                except ValueError as exc:
                    reply = ErrorReply(message=str(exc), status=400)
                except RemoteError as exc:
                    reply = ErrorReply(message=str(exc), status=exc.status)
                except Exception as exc:
                    log.exception("handler for %s failed", subject)
                    reply = ErrorReply(message=f"{type(exc).__name__}: {exc}", status=500)
                if raw.reply and reply is not None:
                    await raw.respond(self._reply_data(reply))

        async def spawn(raw: Msg) -> None:
            task = asyncio.create_task(handle(raw))
            self._tasks.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._tasks.discard)

        callback = spawn if concurrent else handle
        self._subscriptions.append(await self.nc.subscribe(subject, queue=queue, cb=callback))

    def _reply_data(self, reply: Any) -> bytes:
        """The encoded reply, or an ErrorReply saying it was too large to send."""
        try:
            return self._encoded(reply)
        except PayloadTooLarge as exc:
            return pack(ErrorReply(message=f"the reply is too large: {exc}", status=exc.status))

    async def stop_serving(self, subject: str) -> None:
        """Take no more messages on `subject` (a queue group's others get them)."""
        for sub in [s for s in self._subscriptions if s.subject == subject]:
            await sub.unsubscribe()
            self._subscriptions.remove(sub)

    async def close(self) -> None:
        for sub in self._subscriptions:
            await sub.unsubscribe()
        await self.nc.drain()


class Outbox:
    """Publishes, per subject, what was put for it during one event-loop turn as one
    message, `envelope(items)`, in order. A decode step's output for many requests
    thus travels as one message per detokenizer instead of one per request."""

    def __init__(self, bus: Bus, envelope: Callable[[list[Any]], Any]) -> None:
        self.bus = bus
        self.envelope = envelope
        self._turn: dict[str, list[Any]] = {}
        self._ready: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._sender: asyncio.Task[None] | None = None

    def put(self, subject: str, item: Any) -> None:
        if not self._turn:
            asyncio.get_running_loop().call_soon(self._seal)
        self._turn.setdefault(subject, []).append(item)

    def _seal(self) -> None:
        turn, self._turn = self._turn, {}
        for subject, items in turn.items():
            self._ready.put_nowait((subject, self.envelope(items)))
        if self._sender is None:
            self._sender = asyncio.create_task(self._send())

    async def _send(self) -> None:
        while True:  # one sender keeps the messages in order
            subject, msg = await self._ready.get()
            try:
                await self.bus.publish(subject, msg)
            except Exception:  # e.g. reconnecting with a full buffer: later ones may pass
                log.exception("cannot publish to %s", subject)
