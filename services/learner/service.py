"""The learner: one per drafter pool, training its draft model (an EAGLE head, a DFLASH
block draft or a STANDALONE LM: `online_trainer` picks how) on what the pool serves.

Drafters send each finished request (`ServedExample`, with the live acceptance they
counted per head version). The main thread trains: a round of optimizer steps once enough
new examples arrived, then the candidate's held-out acceptance against the pool's version
decides whether it becomes a new version (the pool's version keeps its scores per held-out
example, so it walks only the examples new since its last judging). The io thread watches
the pool, so a bad version goes however long a round takes: a version any drafter refuses
is taken back at once, and a new one, once it has served enough verification steps, if its
live acceptance length is below its baseline's (the nearest earlier version that served
enough) by more than the margin. Heads moved into incoming/ are pushed as new versions. The current
version is announced every heartbeat interval, so a drafter that starts or missed one
catches up.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import shutil
import threading
from pathlib import Path

import numpy as np
import torch
from specmesh.services.learner.config import LearnerConfig, OnlineLearningConfig
from specmesh.services.learner.versions import HeadVersions
from specmesh.shared.config import resolve_device
from specmesh.shared.model.fetch import resolve_model
from specmesh.shared.model.loader import load_model
from specmesh.shared.protocol import (
    HEAD_REFUSED,
    HEAD_VERSION,
    LEARN_EXAMPLES,
    HeadRefused,
    Heartbeat,
    ServedExample,
)
from specmesh.shared.service import Service, ServiceConfig
from specmesh.shared.speculative.config import ONLINE_ALGORITHMS, SpeculativeConfig
from specmesh.shared.telemetry import (
    EXAMPLES_BUFFERED,
    HELDOUT_ACCEPTANCE,
    LIVE_ACCEPTANCE,
    ONLINE_HEAD_VERSION,
    PUBLISHED_VERSIONS,
    ROLLBACKS,
    TRAIN_STEPS,
)
from specmesh.shared.training.eagle_trainer import Acceptance
from specmesh.shared.training.online import OnlineOptions, online_trainer, pooled
from specmesh.shared.transport import TransportConfig

log = logging.getLogger(__name__)

MIN_HELDOUT = 4  # held-out examples before any candidate is judged


class LearnerService(Service):
    kind = "learner"
    computes = True

    def __init__(
        self,
        cfg: ServiceConfig,
        lcfg: LearnerConfig,
        online: OnlineLearningConfig,
        spec: SpeculativeConfig,
        tcfg: TransportConfig,
    ) -> None:
        super().__init__(cfg)
        self.online = online.checked()
        spec = spec.resolved(lcfg.model)
        self.algorithm = spec.speculative_algorithm or ""
        if self.algorithm not in ONLINE_ALGORITHMS:
            raise ValueError(f"a learner trains {', '.join(ONLINE_ALGORITHMS)} drafters")
        device = resolve_device(lcfg.device)
        target_dir = resolve_model(lcfg.model)
        self.target = load_model(str(target_dir), device, torch.float32).requires_grad_(False)
        self.target_config = json.loads((target_dir / "config.json").read_text())
        root = Path(online.speculative_online_dir) / self.algorithm.lower()
        self.examples_path = root / "examples.jsonl"  # the trainer's buffers, for a restart
        base = Path(spec.speculative_draft_model_path or "")
        self.versions = HeadVersions(root, base, self.algorithm)
        self.lock = threading.Lock()  # the versions' state: the io thread's and the trainer's
        self.trained_from = self.versions.current  # the version the trainer's draft grew from
        options = OnlineOptions(
            ttt_steps=spec.speculative_num_steps or 4,
            lr=online.speculative_online_lr,
            buffer_size=online.speculative_online_buffer_size,
            heldout_share=online.speculative_online_heldout_share,
        )
        self.trainer = online_trainer(
            self.algorithm,
            self.target,
            options,
            self.versions.path(self.trained_from),
            self.target_config,
            spec.speculative_token_map,
        )
        self.current_draft = copy.deepcopy(self.trainer.draft).eval()  # the pool's, judged against
        self.current_scores: dict[int, Acceptance] = {}  # its held-out scores, by example
        self.transport = tcfg.open(cfg.nats_url)
        self.live: dict[int, list[int]] = {}  # version -> [verification steps, tokens]
        self.round_left = 0  # optimizer steps left in the round
        self.announcement = self.versions.announcement(self.transport.address)
        ONLINE_HEAD_VERSION.labels(self.kind).set(self.versions.current)
        log.info("learning %s online from version %d", self.algorithm, self.versions.current)

    async def start(self) -> None:
        await self.bus.serve(LEARN_EXAMPLES, self.on_example, queue="learner")
        await self.bus.serve(HEAD_REFUSED, self.on_refused)
        self._announcing = asyncio.create_task(self._announce())

    async def _announce(self) -> None:
        while True:
            for path in self.versions.pushed():
                await asyncio.to_thread(self._push, path)
            head = self.announcement
            try:
                await asyncio.to_thread(self.versions.keep_stored, head, self.transport)
                await self.bus.publish(HEAD_VERSION, head)
            except Exception as exc:  # a store or NATS outage: the next tick tries again
                log.warning("cannot announce head version %d: %s", head.version, exc)
            await asyncio.sleep(self.cfg.heartbeat_interval)

    async def on_example(self, msg: ServedExample) -> None:
        rows = None  # a drafter that reads no features (STANDALONE) sends none
        if msg.feature_dim:
            features = np.frombuffer(msg.features, np.float16).reshape(-1, msg.feature_dim)
            rows = torch.from_numpy(features.copy())
        self.trainer.add(list(msg.token_ids), msg.prompt_len, rows, msg.feature_position)
        for t in msg.acceptance:
            tally = self.live.setdefault(t.version, [0, 0])
            tally[0] += t.steps
            tally[1] += t.tokens
            LIVE_ACCEPTANCE.labels(str(t.version)).set(tally[1] / max(1, tally[0]))
        with self.lock:
            self._judge_live()

    async def on_refused(self, msg: HeadRefused) -> None:
        with self.lock:
            current = self.versions.current
            parent = self.versions.records[current].parent
            if msg.version != current or parent is None:
                return  # old news, or the pool's first head
            log.error(
                "%s refused head version %d (%s): the pool goes back to version %d",
                msg.instance_id,
                msg.version,
                msg.reason,
                parent,
            )
            self._take_back(current, "refused", parent)

    async def stop(self) -> None:
        self._announcing.cancel()
        self.trainer.save_examples(self.examples_path)
        self.transport.close()

    def heartbeat(self) -> Heartbeat:
        EXAMPLES_BUFFERED.labels("train").set(len(self.trainer.train_set))
        EXAMPLES_BUFFERED.labels("heldout").set(len(self.trainer.heldout))
        return Heartbeat(
            kind=self.kind,
            instance_id=self.instance_id,
            metrics_url=self.metrics_url,
            algorithm=self.algorithm,
            head_version=self.announcement.version,
        )

    def _push(self, path: Path) -> None:
        """A head an operator moved into incoming/ becomes the pool's next version,
        relayed as it is: drafters check it."""
        with self.lock:
            try:
                version = self.versions.add(
                    lambda out: shutil.copytree(path, out), self.versions.current, "pushed"
                )
            except (OSError, ValueError) as exc:
                log.error("cannot push %s: %s", path, exc)
            else:
                log.info("pushing %s as head version %d", path.name, version)
                self._publish(version, "pushed")
        shutil.rmtree(path, ignore_errors=True)

    def _judge_live(self) -> None:
        """Keep or take back the version being watched once it has served enough."""
        version = self.versions.current
        record = self.versions.records[version]
        steps, tokens = self.live.get(version, [0, 0])
        if record.status != "serving" or record.parent is None:
            return
        if steps < self.online.speculative_online_rollback_steps:
            return
        live = tokens / steps
        baseline = self._baseline(record.parent)
        if baseline is not None:
            before = self.live[baseline][1] / self.live[baseline][0]
            if live < before - self.online.speculative_online_rollback_margin:
                log.warning(
                    "head version %d drafts worse live (acceptance length %.2f) than version "
                    "%d (%.2f): rolling back",
                    version,
                    live,
                    baseline,
                    before,
                )
                self._take_back(version, "rolled back", baseline)
                return
        log.info("head version %d kept (live acceptance length %.2f)", version, live)
        self.versions.mark(version, "kept")

    def _baseline(self, version: int | None) -> int | None:
        """`version` or its nearest ancestor with enough live steps to compare against."""
        while version is not None:
            if self.live.get(version, [0])[0] >= self.online.speculative_online_rollback_steps:
                return version
            version = self.versions.records[version].parent
        return None

    def _take_back(self, version: int, status: str, to: int) -> None:
        self.versions.mark(version, status)
        self.versions.serve(to)
        self._announce_current()
        ROLLBACKS.inc()

    def _publish(self, version: int, source: str) -> None:
        self.versions.serve(version)
        self._announce_current()
        PUBLISHED_VERSIONS.labels(source).inc()
        log.info("announcing head version %d (%s)", version, source)

    def _announce_current(self) -> None:
        self.announcement = self.versions.announcement(self.transport.address)
        ONLINE_HEAD_VERSION.labels(self.kind).set(self.versions.current)

    def main_loop(self) -> None:
        """Train one step at a time while a round is on, between calls from the io thread."""
        self._restore_examples()
        while self.run_calls(0.0 if self.round_left else 0.5):
            self._follow_the_pool()
            enough = self.trainer.new_examples >= self.online.speculative_online_min_examples
            if not self.round_left and enough:
                self.trainer.take_new()
                self.trainer.save_examples(self.examples_path)
                self.round_left = self.online.speculative_online_round_steps
            if self.round_left:
                self.trainer.train_step()
                TRAIN_STEPS.inc()
                self.round_left -= 1
                if not self.round_left:
                    self._judge_candidate()

    def _restore_examples(self) -> None:
        """What the pool served before a restart trains on, once its features are back."""
        if not self.examples_path.is_file():
            return
        try:
            count = self.trainer.restore_examples(self.examples_path)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:  # a damaged file
            log.warning("cannot restore served examples from %s: %s", self.examples_path, exc)
        else:
            log.info("restored %d served examples from %s", count, self.examples_path)

    def _follow_the_pool(self) -> None:
        """Train from the pool's version once it is one this trainer did not grow and no
        longer watched (a push kept, a rollback's): a round under way is dropped."""
        with self.lock:
            current = self.versions.current
            settled = self.versions.records[current].status == "kept"
        if current != self.trained_from and settled:
            self.current_draft = self.trainer.load(self.versions.path(current))
            self.current_scores = {}
            self.trainer.reset(copy.deepcopy(self.current_draft))
            self.trained_from, self.round_left = current, 0
            log.info("training on from head version %d", current)

    def _judge_candidate(self) -> None:
        """Publish the trained draft if it beats the pool's on held-out traffic."""
        if len(self.trainer.heldout) < MIN_HELDOUT:
            return
        examples = self.trainer.heldout_examples()
        scores = self.trainer.heldout_scores(self.trainer.draft, examples)
        self.current_scores = self.trainer.heldout_scores(
            self.current_draft, examples, self.current_scores
        )
        candidate, current = pooled(scores), pooled(self.current_scores)
        HELDOUT_ACCEPTANCE.labels(str(self.trained_from)).set(current)
        log.info(
            "held-out acceptance length: candidate %.3f, version %d %.3f",
            candidate,
            self.trained_from,
            current,
        )
        if candidate < current + self.online.speculative_online_min_gain:
            return
        draft = copy.deepcopy(self.trainer.draft).eval()
        with self.lock:
            if self.versions.current != self.trained_from:
                return  # the pool moved on while this round ran
            version = self.versions.add(
                lambda path: self.trainer.save(copy.deepcopy(draft), path),
                self.trained_from,
                "trained",
                candidate,
            )
            self._publish(version, "trained")
        self.current_draft, self.current_scores, self.trained_from = draft, scores, version
        HELDOUT_ACCEPTANCE.labels(str(version)).set(candidate)
