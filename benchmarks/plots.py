"""Draw every plot of docs/benchmarks.md from the recorded numbers.

    python benchmarks/plots.py [--results benchmarks/results.json] [--out docs/plots]

Reads `benchmarks/results.json` (the latest measured runs, each with its date, commit and
command) and writes one SVG per figure under `docs/plots/`. It measures nothing: rerun the
command an entry names, put its numbers in the file, and run this again. Needs matplotlib
(the `bench` extra: `pip install -e '.[bench]'`). The SVGs carry no date and fixed ids, so
unchanged numbers give unchanged files.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU = "SmolLM2-135M-Instruct, greedy, 2 CPU cores"
OURS, PEER, THIRD = "#1f77b4", "#ff7f0e", "#2ca02c"


def rows(entry: dict, key: str = "") -> list[dict]:
    """A table of results.json as one dict per row, keyed by its column names."""
    table = entry[key] if key else entry
    return [dict(zip(table["columns"], row, strict=True)) for row in table["rows"]]


def source(entry: dict) -> str:
    return f"{entry['date']}, {entry['commit']}"


def bars(ax, groups: list[str], series: dict[str, list[float]], colors=None) -> None:
    """Grouped bars, each labelled with its value."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        color = colors[i] if colors else None
        drawn = ax.bar(xs, values, width, label=name, color=color)
        ax.bar_label(drawn, [str(v) for v in values], fontsize=7, padding=1)
    ax.set_xticks(range(len(groups)), groups)


def speed_decode(results: dict, plt) -> object:
    fp32 = results["decode_fp32_vs_transformers"]
    f32_peer = results["fp32_vs_llama_cpp"]
    q4 = results["quantized_vs_llama_cpp"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    r = rows(fp32)
    bars(
        axes[0],
        [f"batch {x['batch']}" for x in r],
        {
            "specmesh engine": [x["specmesh_tok_s"] for x in r],
            "transformers generate": [x["transformers_tok_s"] for x in r],
        },
        [OURS, PEER],
    )
    axes[0].set_title(f"fp32, in one process ({source(fp32)})", fontsize=9)
    quiet = [x for x in rows(f32_peer)]
    ours = [x for x in quiet if x["setup"].startswith("specmesh")]
    peer = [x for x in quiet if x["setup"].startswith("llama.cpp")]
    bars(
        axes[1],
        [f"concurrency {x['concurrency']}" for x in ours],
        {
            "specmesh up": [x["quiet_tok_s"] for x in ours],
            "llama-server, F32 GGUF": [x["quiet_tok_s"] for x in peer],
        },
        [OURS, PEER],
    )
    axes[1].set_title(f"fp32 over HTTP ({source(f32_peer)})", fontsize=9)
    q = {x["setup"]: x for x in rows(q4)}
    ours, peer = q["specmesh --quantization gguf"], q["llama.cpp, the same Q4_1 file"]
    bars(
        axes[2],
        ["concurrency 1", "concurrency 8", "concurrency 32"],
        {
            "specmesh up --quantization gguf": [ours["c1"], ours["c8"], ours["c32"]],
            "llama-server": [peer["c1"], peer["c8"], peer["c32"]],
        },
        [OURS, PEER],
    )
    axes[2].set_title(f"Q4_1 GGUF over HTTP ({source(q4)})", fontsize=9)
    for ax in axes:
        ax.set_ylabel("generated tokens/s")
        ax.legend(fontsize=8, loc="upper left")
        ax.margins(y=0.15)
    fig.suptitle(f"Decode speed, no speculation: {CPU}", fontsize=10)
    return fig


def quantized(results: dict, plt) -> object:
    q4 = results["quantized_vs_llama_cpp"]
    r = rows(q4)
    fig, ax = plt.subplots(figsize=(10, 4))
    colors = [OURS, PEER, "#6baed6", "#fdae6b", "#08519c", "#a63603"]
    bars(
        ax,
        ["concurrency 1", "concurrency 8", "concurrency 32"],
        {x["setup"]: [x["c1"], x["c8"], x["c32"]] for x in r},
        colors,
    )
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"Q4_1 GGUF with and without speculation, held-out chat ({source(q4)})")
    ax.legend(fontsize=7, ncols=3, loc="upper left")
    ax.margins(y=0.25)
    return fig


def prefill(results: dict, plt) -> object:
    three = results["prefill_three_way"]
    runs = three["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    setups = {"specmesh": OURS, "transformers": PEER, "llama.cpp": THIRD}
    markers = "sDo^vPX*"  # one per run, oldest first (repeating past the eighth)
    marker = {commit: markers[k % len(markers)] for k, commit in enumerate(runs)}
    offset = {commit: (k - (len(runs) - 1) / 2) * 0.25 for k, commit in enumerate(runs)}
    for ax, length in zip(axes[:2], ("2048", "8190"), strict=True):
        for commit, run in runs.items():
            for i, (setup, color) in enumerate(setups.items()):
                values = run[setup][length]
                x = i + offset[commit]
                ax.scatter([x] * len(values), values, color=color, s=18, marker=marker[commit])
            ax.scatter([], [], color="grey", marker=marker[commit], label=f"run at {commit}")
        ax.set_xticks(range(len(setups)), list(setups))
        ax.set_ylim(bottom=0)
        ax.set_ylabel("seconds to the first token")
        ax.set_title(f"{int(length):,}-token prompt, a point per run", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    ax = axes[2]
    for commit, run in runs.items():
        for j, length in enumerate(("2048", "8190")):
            pairs = zip(run["transformers"][length], run["specmesh"][length], strict=True)
            values = [t / s for t, s in pairs]
            x = j + offset[commit]
            label = f"run at {commit}" if j == 0 else None
            ax.scatter(
                [x] * len(values), values, color=OURS, s=18, marker=marker[commit], label=label
            )
            median = run["median_ratio_vs_transformers"][length]
            ax.hlines(median, x - 0.1, x + 0.1, color=OURS)
            ax.annotate(f"{median:.2f}x", (x + 0.11, median), fontsize=7, va="center")
    ax.axhline(1.2, color="grey", lw=0.8, ls="--")
    ax.set_xticks([0, 1], ["2,048 tokens", "8,190 tokens"])
    ax.set_ylabel("specmesh speed / transformers' (per run)")
    ax.set_title("Against transformers' forward, per run (dashed: 1.2x)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Prefill of one long prompt, fp32: {CPU} (latest {source(three)})", fontsize=10)
    return fig


def speculation(results: dict, plt) -> object:
    entry = results["drafters_over_services"]
    r = rows(entry)
    algorithms = [x["setup"] for x in r if x["set"] == "chat" and x["setup"] != "none"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, workload in zip(axes, ("chat", "copy"), strict=True):
        picked = {x["setup"]: x for x in r if x["set"] == workload}
        values = [picked[a]["vs_none"] for a in algorithms]
        colors = [OURS if v >= 1 else "#c6dbef" for v in values]
        drawn = ax.bar(algorithms, values, color=colors)
        labels = [
            f"{v:.2f}x\naccept {picked[a]['acceptance_length']:.2f}"
            for v, a in zip(values, algorithms, strict=True)
        ]
        ax.bar_label(drawn, labels, fontsize=7, padding=1)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{workload} prompts", fontsize=9)
        ax.margins(y=0.2)
    axes[0].set_ylabel("tokens/s over no speculation")
    fig.suptitle(
        f"Speculation over the services, concurrency 1, fp32: {CPU} ({source(entry)})",
        fontsize=10,
    )
    return fig


def services_cost(results: dict, plt) -> object:
    entry = results["services_vs_engine"]
    r = {x["setup"]: x for x in rows(entry)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    pairs = {
        "no speculation": ("no speculation, in one process", "no speculation over the services"),
        "EAGLE-3": (
            "EAGLE-3 (shipped head), in one process",
            "EAGLE-3 over the services (no overlap: the default)",
        ),
    }
    for ax, (name, (inproc, services)) in zip(axes, pairs.items(), strict=True):
        bars(
            ax,
            ["concurrency 1", "concurrency 8"],
            {
                "one process": [r[inproc]["c1"], r[inproc]["c8"]],
                "specmesh up (five services)": [r[services]["c1"], r[services]["c8"]],
            },
            [PEER, OURS],
        )
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("generated tokens/s")
        ax.legend(fontsize=8, loc="upper left")
        ax.margins(y=0.15)
    fig.suptitle(f"What the services cost, fp32: {CPU} ({source(entry)})", fontsize=10)
    return fig


def kv_transfer(results: dict, plt) -> object:
    entry = results["kv_transfer"]
    r = rows(entry)
    rates = list(dict.fromkeys(x["link_rate"] for x in r))
    fig, axes = plt.subplots(1, len(rates), figsize=(13, 4), sharey=True)
    for ax, rate in zip(axes, rates, strict=True):
        picked = [x for x in r if x["link_rate"] == rate]
        tokens = [x["prompt_tokens"] for x in picked]
        ax.plot(tokens, [x["valkey_ms"] for x in picked], "o-", color=PEER, label="valkey")
        ax.plot(tokens, [x["direct_ms"] for x in picked], "o-", color=OURS, label="direct")
        for x in picked:
            ax.annotate(
                f"{x['valkey_over_direct']:.2f}x",
                (x["prompt_tokens"], x["valkey_ms"]),
                fontsize=7,
                textcoords="offset points",
                xytext=(4, 4),
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(tokens, [f"{t:,}" for t in tokens])
        ax.set_xlabel("prompt tokens")
        ax.set_title(f"link: {rate}", fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel("hand-off ms (write + read)")
    fig.suptitle(
        f"KV blocks from the prefill host to a decode host, fp32 ({source(entry)})", fontsize=10
    )
    return fig


def routing(results: dict, plt) -> object:
    entry = results["routing"]
    r = rows(entry)
    groups = [f"run {x['run']}" for x in r if x["policy"] == "load"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, column, label in (
        (axes[0], "computed", "prompt tokens computed (of 7,065)"),
        (axes[1], "median_ttft_ms", "median time to first token, ms"),
    ):
        bars(
            ax,
            groups,
            {
                policy: [x[column] for x in r if x["policy"] == policy]
                for policy in ("load", "kv-aware")
            },
            [PEER, OURS],
        )
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        ax.margins(y=0.15)
    fig.suptitle(
        f"8 four-turn conversations on 2 decode workers: routing policy ({source(entry)})",
        fontsize=10,
    )
    return fig


def concurrency(results: dict, plt) -> object:
    fp32 = rows(results["decode_fp32_vs_transformers"])
    bf16 = rows(results["decode_bf16"])
    q4 = {x["setup"]: x for x in rows(results["quantized_vs_llama_cpp"])}
    services = rows(results["services_fp32_vs_transformers"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    conc = [1, 8, 32]
    lines = [
        (
            "engine, bf16 weights (2026-11-27)",
            [x["batch"] for x in bf16],
            [x["specmesh_tok_s"] for x in bf16],
            "#9467bd",
            "-",
        ),
        (
            "engine, fp32 (2026-11-25)",
            [x["batch"] for x in fp32],
            [x["specmesh_tok_s"] for x in fp32],
            OURS,
            "-",
        ),
        (
            "transformers, fp32 (2026-11-25)",
            [x["batch"] for x in fp32],
            [x["transformers_tok_s"] for x in fp32],
            PEER,
            "-",
        ),
        (
            "specmesh up, fp32 (2026-11-25)",
            [x["concurrency"] for x in services],
            [x["services_tok_s"] for x in services],
            OURS,
            "--",
        ),
        (
            "specmesh up, Q4_1 GGUF (2026-11-26)",
            conc,
            [q4["specmesh --quantization gguf"][f"c{c}"] for c in conc],
            THIRD,
            "--",
        ),
        (
            "llama-server, Q4_1 GGUF (2026-11-26)",
            conc,
            [q4["llama.cpp, the same Q4_1 file"][f"c{c}"] for c in conc],
            "#d62728",
            "--",
        ),
    ]
    for label, xs, ys, color, style in lines:
        ax.plot(xs, ys, marker="o", ls=style, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc, [str(c) for c in conc])
    ax.set_xlabel("sequences decoded together (batch / concurrency)")
    ax.set_ylabel("generated tokens/s, all sequences")
    ax.set_title("Throughput", fontsize=9)
    ax.legend(fontsize=7)
    side = results["weights_side_by_side"]
    formats = rows(side)
    bars(
        axes[1],
        ["batch 1", "batch 8"],
        {x["weights"]: [x["b1_tok_s"], x["b8_tok_s"]] for x in formats},
        [OURS, "#9467bd", THIRD],
    )
    axes[1].set_ylabel("generated tokens/s")
    axes[1].set_title(f"Weight formats side by side, one process ({side['date']})", fontsize=9)
    axes[1].legend(fontsize=7, loc="upper left")
    axes[1].margins(y=0.15)
    fig.suptitle(f"Scaling with concurrency, no speculation: {CPU}", fontsize=10)
    return fig


def fairness(results: dict, plt) -> object:
    entry = results["fairness"]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot(
        entry["sent_at_s"],
        entry["first_token_s"],
        "o-",
        color=OURS,
        label="short chat beside the long prompt",
    )
    ax.axhline(
        entry["alone_s"],
        color="grey",
        ls="--",
        lw=0.8,
        label=f"the same chat alone ({entry['alone_s']:g} s)",
    )
    ax.axvline(
        entry["long_prompt_s"],
        color=PEER,
        lw=0.8,
        label=f"the 8,190-token prompt answered ({entry['long_prompt_s']:g} s)",
    )
    ax.set_xlabel("when the short chat was sent, seconds after the long prompt")
    ax.set_ylabel("its first token, seconds")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"A long prompt does not block short requests, fp32 ({source(entry)})", fontsize=10
    )
    ax.legend(fontsize=7, loc="upper left")
    return fig


def faults(results: dict, plt) -> object:
    entry = results["faults"]
    r = entry["rows"]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    for i, x in enumerate(r):
        low, high = x["last_stream_after_s"][0], x["last_stream_after_s"][-1]
        ax.plot([low, high], [i, i], color=OURS, lw=6 if high > low else 0, solid_capstyle="butt")
        ax.plot([low, high], [i, i], "o", color=OURS)
        label = f"{low}-{high} s" if high > low else f"{low} s"
        ax.annotate(
            f"{label}; {x['failed_streams']} streams failed in {x['tries']} tries",
            (high, i),
            fontsize=7,
            textcoords="offset points",
            xytext=(6, -3),
        )
    ax.set_yticks(range(len(r)), [x["fault"] for x in r], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 21)
    ax.set_xlabel("seconds from the fault until the last open stream ended")
    ax.set_title(
        f"Faults mid-stream: every output equal to its no-fault text ({entry['date']})", fontsize=10
    )
    return fig


def cotenancy(results: dict, plt) -> object:
    entry = results["fp32_vs_llama_cpp"]
    r = rows(entry)
    groups = [f"{x['setup'].split(',')[0]}\nconcurrency {x['concurrency']}" for x in r]
    fig, ax = plt.subplots(figsize=(10, 4))
    bars(
        ax,
        groups,
        {
            "quiet": [x["quiet_tok_s"] for x in r],
            "beside a busy loop at nice 19": [x["busy_nice19_tok_s"] for x in r],
            "beside a busy loop at nice 0": [x["busy_nice0_tok_s"] for x in r],
        },
        ["#08519c", "#6baed6", "#c6dbef"],
    )
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"Sharing the 2 cores with another process, fp32 ({source(entry)})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.margins(y=0.15)
    return fig


def gpu(results: dict, plt) -> object:
    entry = results["gpu_h200"]
    r = rows(entry)
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [x["backend"] + ("" if x["cuda_graphs"] != "yes" else " + CUDA graphs") for x in r]
    bars(
        ax,
        ["batch 1", "batch 8", "batch 64"],
        {name: [x["b1"], x["b8"], x["b64"]] for name, x in zip(names, r, strict=True)},
        [PEER, "#9ecae1", "#4292c6", "#08519c"],
    )
    ax.set_yscale("log")
    ax.set_ylabel("generated tokens/s (log)")
    ax.set_title(
        f"One H200, random bf16 weights of SmolLM2-135M's shape ({source(entry)})", fontsize=10
    )
    ax.legend(fontsize=8, loc="upper left")
    ax.margins(y=0.2)
    return fig


def compose(results: dict, plt) -> object:
    first, check = results["compose_first_run"], results["compose_check"]
    r = rows(first)
    r += [dict(x, commit=check["commit"]) for x in rows(check)]
    fig, ax = plt.subplots(figsize=(10, 3.5))
    labelled: set[str] = set()

    def once(label: str) -> str | None:
        """The label the first time, then None: one legend entry per kind of bar."""
        if label in labelled:
            return None
        labelled.add(label)
        return label

    for i, x in enumerate(r):
        images, healthy, total = x["images_ready_s"], x["healthy_after_up_s"], x["total_s"]
        ax.barh(i, images, color="#9ecae1", label=once("images ready"))
        if healthy is not None:
            ax.barh(
                i, healthy, left=images, color=OURS, label=once("up to every container healthy")
            )
            text = f"{images} s + {healthy} s"
            end = images + healthy
        else:
            ax.barh(
                i, total, fill=False, hatch="//", edgecolor=OURS, label="healthy, from the command"
            )
            text = f"images {images} s; healthy {total} s after the command"
            end = total
        ax.annotate(
            f"{text} ({x['commit']})",
            (end, i),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, -3),
        )
    ax.set_yticks(range(len(r)), [x["step"] for x in r], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1400)
    ax.set_xlabel("seconds")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"scripts/compose-local, 2 shared CPU cores ({first['date']})", fontsize=10)
    return fig


PLOTS: dict[str, Callable] = {
    "speed_decode": speed_decode,
    "quantized": quantized,
    "prefill": prefill,
    "speculation": speculation,
    "services_cost": services_cost,
    "kv_transfer": kv_transfer,
    "routing": routing,
    "concurrency": concurrency,
    "fairness": fairness,
    "faults": faults,
    "cotenancy": cotenancy,
    "gpu": gpu,
    "compose": compose,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "plots")
    parser.add_argument("--only", default="", help="comma-separated plot names")
    args = parser.parse_args()
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    matplotlib.rcParams["svg.hashsalt"] = "specmesh"
    matplotlib.rcParams["svg.fonttype"] = "none"  # text as text: small files, searchable
    results = json.loads(args.results.read_text())["results"]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, draw in PLOTS.items():
        if args.only and name not in args.only.split(","):
            continue
        fig = draw(results, plt)
        fig.tight_layout()
        path = args.out / f"{name}.svg"
        fig.savefig(path, metadata={"Date": None})
        plt.close(fig)
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    main()
