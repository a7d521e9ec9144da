#!/usr/bin/env python3
"""The agent case end to end: TTFT of a turn whose prompt is ~7.5K cached + ~0.5K new tokens,
divided by the TTFT of a same-sized prompt nobody has sent before, through an OpenAI-compatible
endpoint (`epd serve`). Standard library only. docs/bench.md "Agent case" has the figures.

Per round r (--rounds, median over rounds):
  1. prime:  one user message A_r (~--cached-tokens tokens), max_tokens 1: the encoder stores
             A_r's blocks in the kvstore;
  2. hit:    one user message A_r + B_r (B_r ~--new-tokens new tokens): the prefix is cached;
  3. cold:   one user message A'_r + B_r, A'_r fresh text of A_r's length: nothing cached.
TTFT = request sent to the first SSE chunk carrying text (as `epd bench` counts it). The texts
are pseudo-words from a seeded generator, sized from a first calibration request's
usage.prompt_tokens. Prints one line per round and, last, `agent_ttft ratio: <hit/cold>`.
"""
import argparse
import json
import random
import statistics
import sys
import time
import urllib.request

WORDS = ("build test error warning file line module function return value config cache token "
         "layer block store index query answer tool output terminal source page result state "
         "request stream batch memory thread process daemon worker router encoder decoder").split()


def text(seed, chars):
    rng = random.Random(seed)
    out = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS) + (str(rng.randrange(1000)) if rng.random() < 0.3 else "")
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def ask(url, model, content, timeout):
    """Streams one chat completion; returns (ttft seconds, usage dict)."""
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 1,
        "temperature": 0,
    }).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json",
                                          "Accept": "text/event-stream"})
    start = time.monotonic()
    ttft = None
    usage = {}
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            for choice in event.get("choices", []):
                delta = choice.get("delta", {})
                if ttft is None and (delta.get("content") or delta.get("reasoning_content")):
                    ttft = time.monotonic() - start
            if event.get("usage"):
                usage = event["usage"]
    if ttft is None:  # no text at all (e.g. an immediate stop): the end of the stream
        ttft = time.monotonic() - start
    return ttft, usage


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="epd-nano")
    ap.add_argument("--cached-tokens", type=int, default=7500)
    ap.add_argument("--new-tokens", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=600)
    a = ap.parse_args()

    probe_chars = 8000
    _, usage = ask(a.url, a.model, text(a.seed * 1000 + 999, probe_chars), a.timeout_s)
    chars_per_token = probe_chars / max(1, usage.get("prompt_tokens", probe_chars // 4))
    cached_chars = int(a.cached_tokens * chars_per_token)
    new_chars = int(a.new_tokens * chars_per_token)
    print(f"calibration: {chars_per_token:.2f} chars/token; A {cached_chars} chars, "
          f"B {new_chars} chars")
    hits, colds = [], []
    for r in range(a.rounds):
        base = a.seed * 1000 + r * 3
        prefix, fresh, new = text(base, cached_chars), text(base + 1, cached_chars), text(
            base + 2, new_chars)
        ask(a.url, a.model, prefix, a.timeout_s)
        hit, hit_usage = ask(a.url, a.model, prefix + "\n\n" + new, a.timeout_s)
        cold, cold_usage = ask(a.url, a.model, fresh + "\n\n" + new, a.timeout_s)
        cached = (hit_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        cold_cached = (cold_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        print(f"round {r}: hit prompt {hit_usage.get('prompt_tokens')} tokens, cached {cached}, "
              f"TTFT {hit * 1e3:.0f} ms; cold prompt {cold_usage.get('prompt_tokens')} tokens, "
              f"cached {cold_cached}, TTFT {cold * 1e3:.0f} ms; ratio {hit / cold:.3f}")
        hits.append(hit)
        colds.append(cold)
    ratio = statistics.median(hits) / statistics.median(colds)
    print(f"median TTFT: hit {statistics.median(hits) * 1e3:.0f} ms, "
          f"cold {statistics.median(colds) * 1e3:.0f} ms")
    print(f"agent_ttft ratio: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
