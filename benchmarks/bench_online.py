"""Online learning: does the pool's EAGLE-3 head learn a prompt source it never saw?

    python benchmarks/bench_online.py [--requests 1000] [--test 50] [--new-tokens 80]
        [--concurrency 8] [--speed-requests N] [--learner-nice 19] [--learner-idle]
        [--out DIR]

The source: "explain this Python function" over functions and methods of the standard
library (the shipped head trained on chat). Test prompts: the first `--test` prompts
the learner's hash holds out (`is_heldout`); they never reach the deployment, so no
version is trained or chosen on them. The replay is the source's other prompts in order,
held-out ones among them as in real traffic (the learner judges candidates on those).

1. Learning off: the first `--speed-requests` replay prompts (default: all of them),
   generated tokens/s.
2. Learning on (a fresh learner directory): the replay of `--requests` prompts, printing
   tokens/s and the pool's head version per 100; the first `--speed-requests` give the
   on/off speed ratio (the same prompts, while the learner trains beside them). After
   the replay it waits for the round under way to end (`--settle-minutes` at most).
3. Acceptance on the test prompts of the versions the pool drafted with at the start,
   halfway, at the end of the replay and after it settled, each measured in-process
   (the same drafts as over the services, tests/test_services.py) from the learner's
   checkpoint of that version.
Greedy; acceptance length = 1 + accepted drafts / verification steps, over all requests.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import shutil
import sys
import sysconfig
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from deployment import specmesh_up  # noqa: E402
from specmesh.shared.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from specmesh.shared.infra import start_nats  # noqa: E402
from specmesh.shared.model.fetch import fetch_default_model  # noqa: E402
from specmesh.shared.sampling.params import SamplingParams  # noqa: E402
from specmesh.shared.speculative.config import SpeculativeConfig  # noqa: E402
from specmesh.shared.tokenizer import Tokenizer  # noqa: E402
from specmesh.shared.training.online import is_heldout  # noqa: E402

HELDOUT_SHARE = 0.1  # the learner's default --speculative-online-heldout-share


def stdlib_functions(limit: int) -> list[str]:
    """Short functions and methods of the standard library (tests left out), in a fixed
    order."""
    found: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            source = path.read_text()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno <= 16:
                found.append(
                    textwrap.dedent(ast.get_source_segment(source, node, padded=True) or "")
                )
        if len(found) >= limit:
            break
    return found[:limit]


def prompt_of(function: str) -> str:
    return f"Explain briefly what this Python function does:\n\n```python\n{function}\n```"


def split(tok: Tokenizer, replay: int, test: int) -> tuple[list[str], list[list[int]]]:
    """(replay prompts, test prompts' ids): the first `test` held-out prompts of the
    source are the test set, the next `replay` others the replay."""
    stream, held = [], []
    for function in stdlib_functions(2 * (replay + test)):
        prompt = prompt_of(function)
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        if len(held) < test and is_heldout(ids, HELDOUT_SHARE):
            held.append(ids)
        elif len(stream) < replay:
            stream.append(prompt)
        if len(stream) == replay and len(held) == test:
            return stream, held
    sys.exit(f"the standard library gave {len(stream)} + {len(held)} prompts")


class Replay:
    """Requests over HTTP at a fixed concurrency; tokens and speculation counts summed."""

    def __init__(self, url: str, new_tokens: int, concurrency: int) -> None:
        self.url, self.new_tokens, self.concurrency = url, new_tokens, concurrency

    def one(self, prompt: str) -> tuple[int, int, int]:
        """Tokens generated, verification steps, accepted drafts."""
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": self.new_tokens,
        }
        r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        reply = r.json()
        spec = reply["metrics"]["speculative_decoding"]
        tokens = reply["usage"]["completion_tokens"]
        return tokens, spec["num_spec_steps"], spec["num_accepted_draft_tokens"]

    def run(self, prompts: list[str]) -> dict[str, float]:
        start = time.perf_counter()
        with ThreadPoolExecutor(self.concurrency) as pool:
            results = list(pool.map(self.one, prompts))
        seconds = time.perf_counter() - start
        tokens, steps, accepted = (sum(column) for column in zip(*results, strict=True))
        return {
            "tok_s": tokens / seconds,
            "acceptance": 1 + accepted / max(1, steps),
            "seconds": seconds,
        }


@contextmanager
def deployment(
    model: Path, online_dir: Path | None, log: Path, learner: list[str]
) -> Iterator[str]:
    """EAGLE-3 over the services, learning online into `online_dir` if given (the learner
    placed by `learner`, `specmesh up` flags): its URL."""
    args = ["--speculative-algorithm", "EAGLE3"]
    if online_dir is not None:
        args += ["--speculative-online-learning", "--speculative-online-dir", str(online_dir)]
        args += learner
    with start_nats() as bus, specmesh_up(model, "--nats-url", bus.url, *args, log=log) as url:
        yield url


def current_version(online_dir: Path) -> int:
    return json.loads((online_dir / "eagle3" / "state.json").read_text())["current"]


def test_acceptance(
    model: Path, head: Path, prompts: list[list[int]], new_tokens: int, batch: int
) -> float:
    """Acceptance length of EAGLE-3 with the head at `head` on `prompts`, in-process."""
    spec = SpeculativeConfig(
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(head),
        speculative_adaptive=False,
    )
    engine = LLMEngine(EngineConfig(model=str(model), kv_cache_gb=0.5), spec)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    for i in range(0, len(prompts), batch):
        engine.generate(prompts[i : i + batch], params)
    return engine.speculator.stats.acceptance_length


def main() -> None:
    parser = argparse.ArgumentParser(
        description=inspect.cleandoc(__doc__ or ""), formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--test", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=80)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--speed-requests",
        type=int,
        default=None,
        help="replay prompts whose speed is compared, learning on and off (default: all: "
        "the whole time the learner trains)",
    )
    parser.add_argument("--settle-minutes", type=float, default=10.0)
    parser.add_argument(
        "--learner-nice",
        type=int,
        default=19,
        help="the learner's niceness: 19 trains on idle cores only; lower takes more of "
        "them from serving",
    )
    parser.add_argument(
        "--learner-idle",
        action="store_true",
        help="the learner at SCHED_IDLE: only CPU time serving leaves",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_online_out"))
    args = parser.parse_args()
    learner = ["--learner-nice", str(args.learner_nice)]
    learner += ["--learner-idle"] if args.learner_idle else []
    model = args.model or fetch_default_model()
    stream, test = split(Tokenizer(model), args.requests, args.test)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, dict] = {}

    def emit(name: str, value: dict) -> None:
        report[name] = value
        print(f"{name}: {json.dumps(value)}", flush=True)
        (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")

    speed = stream[: args.speed_requests or args.requests]
    with deployment(model, None, args.out / "off.log", learner) as url:
        emit("off", Replay(url, args.new_tokens, args.concurrency).run(speed))

    online = args.out / "online"
    shutil.rmtree(online, ignore_errors=True)
    log = args.out / "on.log"
    with deployment(model, online, log, learner) as url:
        versions = {"start": current_version(online)}
        replay = Replay(url, args.new_tokens, args.concurrency)
        for start in range(0, args.requests, 100):
            end = min(start + 100, args.requests)
            part = replay.run(stream[start:end])
            emit(f"served_{end}", part | {"version": current_version(online)})
            if end == len(speed):
                first = [report[f"served_{n}"] for n in range(100, end + 1, 100)]
                seconds = sum(p["seconds"] for p in first)
                tokens = sum(p["tok_s"] * p["seconds"] for p in first)
                emit("on_first", {"tok_s": tokens / seconds, "seconds": seconds})
            if end >= args.requests // 2 and "during" not in versions:
                versions["during"] = current_version(online)
        versions["end"] = current_version(online)
        judged = log.read_text().count("held-out acceptance length:")
        deadline = time.monotonic() + args.settle_minutes * 60
        while (
            time.monotonic() < deadline
            and log.read_text().count("held-out acceptance length:") == judged
        ):
            time.sleep(10)
        versions["after"] = current_version(online)
    state = json.loads((online / "eagle3" / "state.json").read_text())
    emit("versions", state["versions"])
    measured: dict[int, float] = {}
    for moment, version in versions.items():
        if version not in measured:
            head = online / "eagle3" / "versions" / str(version)
            measured[version] = test_acceptance(
                model, head, test, args.new_tokens, args.concurrency
            )
        emit(f"test_{moment}", {"version": version, "acceptance": measured[version]})
    gain = report["test_after"]["acceptance"] - report["test_start"]["acceptance"]
    ratio = report["on_first"]["tok_s"] / report["off"]["tok_s"]
    print(
        f"test acceptance length {report['test_start']['acceptance']:.2f} -> "
        f"{report['test_after']['acceptance']:.2f} (+{gain:.2f}); tokens/s over the first "
        f"{len(speed)} requests, learning on / off: {ratio:.2f}x"
    )


if __name__ == "__main__":
    main()
