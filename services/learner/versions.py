"""The pool's head versions: checkpoints on the learner's disk, blobs in the KV store.

`root/versions/<n>/` holds version n as a checkpoint; `root/state.json` says which one the
pool drafts with and what became of each. Version 0 is the head the pool started from.
Checkpoint directories moved into `root/incoming/` are pushed to the pool as new
versions (an operator's offline-trained head), relayed as bytes: drafters check them.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from specmesh.shared.protocol import HeadVersion
from specmesh.shared.speculative.head_blob import CONFIG, WEIGHTS, blob_sha256, head_key
from specmesh.shared.transport.base import KVTransport

STORE_TTL_S = 24 * 3600.0  # a blob outlives any learner outage short of a day


@dataclass
class VersionRecord:
    parent: int | None
    source: str  # base, trained or pushed
    sha256: str
    status: str = "new"  # then serving (watched), kept, replaced, rolled back or refused
    heldout_acceptance: float | None = None


class HeadVersions:
    def __init__(self, root: Path, base: Path, algorithm: str) -> None:
        self.root, self.algorithm = root, algorithm
        self.records: dict[int, VersionRecord] = {}
        self.current = 0
        (root / "incoming").mkdir(parents=True, exist_ok=True)
        if (root / "state.json").is_file():
            state = json.loads((root / "state.json").read_text())
            self.current = state["current"]
            self.records = {int(v): VersionRecord(**r) for v, r in state["versions"].items()}
        else:
            self.add(lambda path: _copy_checkpoint(base, path), None, "base")
            self.serve(0)

    def path(self, version: int) -> Path:
        return self.root / "versions" / str(version)

    def add(
        self,
        write: Callable[[Path], None],
        parent: int | None,
        source: str,
        heldout_acceptance: float | None = None,
    ) -> int:
        """A new version, written by `write(directory)`; returns its number."""
        version = max(self.records, default=-1) + 1
        path = self.path(version)
        shutil.rmtree(path, ignore_errors=True)  # a version written halfway before a crash
        write(path)
        sha = blob_sha256((path / WEIGHTS).read_bytes())
        self.records[version] = VersionRecord(parent, source, sha, "new", heldout_acceptance)
        self._save()
        return version

    def serve(self, version: int) -> None:
        """Make `version` the pool's; one still watched (serving) is replaced, and the
        version it goes back to, if any, is watched no more (kept)."""
        if self.records[self.current].status == "serving":
            self.records[self.current].status = "replaced"
        record = self.records[version]
        record.status = "serving" if record.status == "new" else "kept"
        self.current = version
        self._save()

    def mark(self, version: int, status: str) -> None:
        self.records[version].status = status
        self._save()

    def pushed(self) -> list[Path]:
        """Checkpoint directories waiting in incoming/, oldest name first."""
        return sorted(p for p in (self.root / "incoming").iterdir() if p.is_dir())

    def announcement(self, source: str | None = None) -> HeadVersion:
        """`source`: the learner's direct store (HeadVersion.source)."""
        record = self.records[self.current]
        return HeadVersion(
            algorithm=self.algorithm,
            version=self.current,
            key=head_key(self.algorithm, record.sha256),
            sha256=record.sha256,
            config=(self.path(self.current) / CONFIG).read_text(),
            source=source,
        )

    def keep_stored(self, head: HeadVersion, transport: KVTransport) -> None:
        """Have the announced blob in the store (a flushed or restarted store loses it)."""
        if transport.count_present([head.key]):
            transport.touch([head.key], STORE_TTL_S)
            return
        blob = (self.path(head.version) / WEIGHTS).read_bytes()
        transport.put_many({head.key: blob}, STORE_TTL_S)

    def _save(self) -> None:
        state = {
            "current": self.current,
            "versions": {v: asdict(r) for v, r in self.records.items()},
        }
        tmp = self.root / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, self.root / "state.json")


def _copy_checkpoint(source: Path, path: Path) -> None:
    """config.json and the weights of the checkpoint at `source` into `path`."""
    path.mkdir(parents=True)
    for name in (CONFIG, WEIGHTS):
        if not (source / name).is_file():
            raise ValueError(f"{source} is not a head checkpoint: it has no {name}")
        shutil.copyfile(source / name, path / name)
