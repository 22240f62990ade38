"""Drives an LLMEngine for asyncio code running on another thread.

The step loop owns the engine; requests and aborts reach it through an inbox,
so an asyncio handler never waits for a model step to finish. The loop runs on
a thread of its own, or (services) on the process's main thread: torch's
parallel CPU kernels run up to ~1.7x slower on a thread started later (measured
on our 2-core machines: a decode step 35 -> 55 ms), so the services keep model
work on the main thread and their asyncio loop on another.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Future
from typing import TypeVar

from specmesh.shared.core.images import PromptImage
from specmesh.shared.core.sequence import RemotePrefix
from specmesh.shared.engine.engine import FirstToken, LLMEngine, TokenOutput
from specmesh.shared.sampling.params import SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")
_Item = list[TokenOutput] | Exception  # a step's tokens for a request, or its failure
_Queue = asyncio.Queue[_Item]
_Stream = tuple[asyncio.AbstractEventLoop, _Queue]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, own_thread: bool = True) -> None:
        """Without `own_thread`, the caller runs `run()` (on the main thread)."""
        self.engine = engine
        self._inbox: list[Callable[[], None]] = []
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._thread = None
        if own_thread:
            self._thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)
            self._thread.start()

    def _post(self, command: Callable[[], None]) -> None:
        with self._inbox_lock:
            self._inbox.append(command)
        self._wake.set()

    async def call(self, fn: Callable[[], T]) -> T:
        """`fn()` on the step loop's thread, between steps (the engine is not thread-safe)."""
        done: Future[T] = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except Exception as exc:
                done.set_exception(exc)

        self._post(run)
        return await asyncio.wrap_future(done)

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        remote_kv: RemotePrefix | None = None,
        first: FirstToken | None = None,
        images: list[PromptImage] | None = None,
    ) -> AsyncIterator[list[TokenOutput]]:
        """Stream the request's tokens, each step's together (several when drafts were
        accepted). Raises ValueError for a request that cannot run; leaving the
        iteration early (client gone) aborts the request. See LLMEngine.add_request."""
        # Off this loop: compiling a large grammar must not hold up other requests' output.
        await asyncio.to_thread(self.engine.check_request, prompt_ids, params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        queue: _Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._post(lambda: self._add(request_id, prompt_ids, params, remote_kv, first, images))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item[-1].finish_reason is not None
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(lambda: self.engine.abort(request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        remote_kv: RemotePrefix | None,
        first: FirstToken | None,
        images: list[PromptImage] | None = None,
    ) -> None:
        try:
            outputs = self.engine.add_request(
                request_id, prompt_ids, params, remote_kv, first, images
            )
        except ValueError as exc:
            self._deliver(request_id, exc)
            return
        if outputs:
            self._deliver(request_id, outputs)

    def _deliver(self, request_id: str, item: _Item) -> None:
        self._deliver_step({request_id: item})

    def run(self) -> None:
        """The step loop, until shutdown()."""
        while not self._stopped:
            with self._inbox_lock:
                commands, self._inbox = self._inbox, []
            for command in commands:
                command()
            if not self.engine.has_work():
                self._wake.wait(0.5)  # a timeout lets the main thread take signals
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step must not take the server down
                log.exception("engine step failed; failing the requests in flight")
                for request_id in list(self.engine.sequences):
                    try:
                        self.engine.abort(request_id)
                    except Exception:  # keep failing the others; the loop must live on
                        log.exception("aborting %s failed too", request_id)
                    self._deliver(request_id, RuntimeError(f"engine step failed: {exc}"))
                continue
            by_request: dict[str, list[TokenOutput]] = {}
            for out in outputs:
                by_request.setdefault(out.request_id, []).append(out)
            failed = {
                request_id: RuntimeError(f"this request's engine step failed: {exc}")
                for request_id, exc in self.engine.take_failed().items()
            }
            self._deliver_step({**by_request, **failed})

    def _deliver_step(self, by_request: Mapping[str, _Item]) -> None:
        """A step's outputs, with one wake-up of each event loop (not one per request),
        so its consumers see the whole step in one turn."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Queue, _Item]]] = {}
        for request_id, items in by_request.items():
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], items))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)


def _put_all(puts: list[tuple[_Queue, _Item]]) -> None:
    for queue, items in puts:
        queue.put_nowait(items)
