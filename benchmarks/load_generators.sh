#!/usr/bin/env bash
# Run SGLang's bench_serving and NVIDIA's aiperf against a running `specmesh up` gateway.
#
#   benchmarks/load_generators.sh http://127.0.0.1:8100
#
# The load generators get their own virtual environment (LG_VENV), apart from the project's;
# nothing is downloaded at run time: the tokenizer is read from a local directory.
# Each tool must finish with zero failed requests, or the script exits non-zero.
#
# Environment (defaults in brackets):
#   LG_VENV      venv for the load generators              [/tmp/lg-venv]
#   LG_PYTHON    interpreter that creates it                [python3.11]
#   LG_OUT       where results and logs go                  [/tmp/lg-out]
#   MODEL        served model id                            [SmolLM2-135M-Instruct]
#   TOKENIZER    local HF tokenizer directory               [~/.cache/specmesh/models/$MODEL]
#   NUM_PROMPTS  requests per tool                          [32]
#   CONCURRENCY  requests in flight                         [4]
#   ISL / OSL    input / output tokens per request          [128 / 64]
set -euo pipefail

URL="${1:?usage: $0 GATEWAY_URL   (e.g. http://127.0.0.1:8100)}"
URL="${URL%/}"
URL="${URL%/v1}"
LG_VENV="${LG_VENV:-/tmp/lg-venv}"
LG_PYTHON="${LG_PYTHON:-python3.11}"
LG_OUT="${LG_OUT:-/tmp/lg-out}"
MODEL="${MODEL:-SmolLM2-135M-Instruct}"
TOKENIZER="${TOKENIZER:-$HOME/.cache/specmesh/models/$MODEL}"
NUM_PROMPTS="${NUM_PROMPTS:-32}"
CONCURRENCY="${CONCURRENCY:-4}"
ISL="${ISL:-128}"
OSL="${OSL:-64}"

PY="$LG_VENV/bin/python"
mkdir -p "$LG_OUT"

# --- install (once) ---------------------------------------------------------------------------
if [ ! -x "$LG_VENV/bin/aiperf" ]; then
    "$LG_PYTHON" -m venv "$LG_VENV"
    "$PY" -m pip install -q --upgrade pip
    # sglang without its (GPU) dependencies, then only what sglang.bench_serving imports.
    "$PY" -m pip install -q --no-deps sglang==0.5.9
    "$PY" -m pip install -q aiohttp numpy pybase64 requests tqdm pillow datasets \
        transformers==4.57.1 ipython pydantic
    "$PY" -m pip install -q aiperf==0.13.0
fi

server_info() { "$PY" -c 'import json, sys, urllib.request
print(urllib.request.urlopen(sys.argv[1] + "/get_server_info").read().decode())' "$URL"; }

# --- SGLang bench_serving ---------------------------------------------------------------------
# random-ids draws token ids at random: no ShareGPT download. bench_serving reads the
# acceptance length from /get_server_info after the run (sglang backends only).
rm -f "$LG_OUT/sglang_bench.jsonl"
"$PY" -m sglang.bench_serving \
    --backend sglang-oai-chat --base-url "$URL" \
    --model "$TOKENIZER" --served-model-name "$MODEL" --tokenizer "$TOKENIZER" \
    --dataset-name random-ids --random-input-len "$ISL" --random-output-len "$OSL" \
    --random-range-ratio 1.0 --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY" \
    --request-rate inf --seed 1 --output-file "$LG_OUT/sglang_bench.jsonl" \
    | tee "$LG_OUT/sglang_bench.txt"
"$PY" - "$LG_OUT/sglang_bench.jsonl" "$NUM_PROMPTS" <<'EOF'
import json, sys
result = json.loads(open(sys.argv[1]).read().splitlines()[-1])
failed = int(sys.argv[2]) - result["completed"]
print(f"bench_serving: {result['completed']} succeeded, {failed} failed, "
      f"accept length {result['accept_length']}")
sys.exit(1 if failed or not result["accept_length"] else 0)
EOF

# --- aiperf -----------------------------------------------------------------------------------
# HF_HUB_OFFLINE must stay unset: aiperf 0.13 treats every tokenizer name as a hub repo id when
# it is set, and a local directory then fails; with it unset a local path loads directly.
# --request-rate well above what the server sustains keeps --concurrency the binding limit;
# without any rate aiperf's timing_manager busy-polls for a free slot and takes a whole core
# (half of a 2-core machine) away from the server.
server_info > "$LG_OUT/aiperf_server_info_before.json"
rm -rf "$LG_OUT/aiperf"
env -u HF_HUB_OFFLINE "$LG_VENV/bin/aiperf" profile \
    --model "$MODEL" --url "$URL" --endpoint-type chat --streaming --tokenizer "$TOKENIZER" \
    --synthetic-input-tokens-mean "$ISL" --synthetic-input-tokens-stddev 0 \
    --output-tokens-mean "$OSL" --output-tokens-stddev 0 \
    --extra-inputs '{"ignore_eos": true, "temperature": 0}' \
    --concurrency "$CONCURRENCY" --request-rate 10 --request-count "$NUM_PROMPTS" \
    --warmup-request-count 1 \
    --random-seed 1 --ui-type none --no-gpu-telemetry --artifact-dir "$LG_OUT/aiperf" \
    > "$LG_OUT/aiperf.log" 2>&1
server_info > "$LG_OUT/aiperf_server_info_after.json"
cat "$LG_OUT/aiperf/profile_export_console.txt"
# aiperf has no acceptance length of its own for this server: take it from the server's
# counters over the aiperf run (tokens per verify step = 1 + accepted drafts / steps).
"$PY" - "$LG_OUT" "$NUM_PROMPTS" <<'EOF'
import json, sys
out, expected = sys.argv[1], int(sys.argv[2])
result = json.load(open(f"{out}/aiperf/profile_export_aiperf.json"))
ok = int(result["request_count"]["avg"])
errors = sum(int(e.get("count", 0)) for e in result.get("error_summary") or [])
before, after = (json.load(open(f"{out}/aiperf_server_info_{w}.json"))["internal_states"][0]
                 for w in ("before", "after"))
steps = after["spec_verify_steps"] - before["spec_verify_steps"]
accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
accept = 1 + accepted / steps if steps else 0.0
print(f"aiperf: {ok} succeeded, {errors} failed; server acceptance length over the run "
      f"{accept:.2f} ({accepted} accepted drafts / {steps} verify steps, "
      f"{after['speculative_algorithm']})")
sys.exit(1 if errors or ok != expected or not steps else 0)
EOF
