"""Does the served demo model answer about the question's topic? (issue 18, docs/demo.md)

Starts `epd serve` (default flags, models/epd-nano), asks the 16 chat questions of
tests/bench/dspark_serve_bench.py under a few sampling settings and counts, per setting, the
distinct answers and the answers that contain a content word of their question (the question's
words minus a short list of function words; a plural also matches its singular).

  python3 tools/train/topic_check.py [--epd build/epd] [--max-tokens 48]
"""

import argparse
import json
import os
import re
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "bench"))
import dspark_serve_bench as bench  # noqa: E402

FUNCTION_WORDS = set("tell me about what is a an the how do i does work explain".split())
SETTINGS = [
    ("greedy", {"temperature": 0}),
    ("greedy, frequency_penalty 1.0 (the README request)", {"temperature": 0,
                                                            "frequency_penalty": 1.0}),
    ("T 0.7, top_p 0.9, seed 1", {"temperature": 0.7, "top_p": 0.9, "seed": 1}),
    ("T 1.0, seed 1", {"temperature": 1.0, "seed": 1}),
]


def ask(port, question, max_tokens, extra):
    body = {"model": "epd-nano", "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens}
    body.update(extra)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]["message"]["content"]


def on_topic(question, answer):
    words = [w for w in re.findall(r"[a-z]+", question.lower()) if w not in FUNCTION_WORDS]
    a = answer.lower()
    return [w for w in words if w in a or (w.endswith("s") and w[:-1] in a)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epd", default="build/epd")
    ap.add_argument("--model", default="models/epd-nano")
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args()
    serve = bench.Serve(a.epd, a.model, "on", [])
    try:
        for name, extra in SETTINGS:
            answers = {q: ask(serve.http, q, a.max_tokens, extra) for q in bench.PROMPTS}
            hits = {q: on_topic(q, ans) for q, ans in answers.items()}
            n_hit = sum(1 for h in hits.values() if h)
            print(f"{name}: {len(set(answers.values()))} distinct answers of {len(answers)}, "
                  f"{n_hit} contain a content word of their question")
            for q in bench.PROMPTS[:3]:
                print(f"  {q!r} -> {answers[q][:100]!r} {hits[q]}")
    finally:
        serve.stop()


if __name__ == "__main__":
    main()
