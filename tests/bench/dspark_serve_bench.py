#!/usr/bin/env python3
"""DSpark on vs off through `epd serve` (real processes): decode tokens/s at batch 1 and 8,
acceptance per draft position, greedy outputs identical (docs/dspark.md, docs/demo.md).

  python3 tests/bench/dspark_serve_bench.py [--epd build/epd] [--model models/epd-nano] \
      [--batches 1,8] [--max-tokens 64] [--rounds 3] [--json OUT.json]

It starts `epd serve --dspark on` and `epd serve --dspark off` side by side on free ports, each
with its own data directory, and for each batch size b sends every prompt to both (alternating
which goes first, so both see the same machine load) as one streaming chat request (temperature
0) with n = b: the decode worker forks the hand-off into b sequences that
decode as one batch from the first token to the last, `--rounds` times. Decode time is measured
end to end, not from chunk arrival times (the decode worker's sender thread bundles the tokens of
several steps into one message when it is scheduled late, which on a loaded machine makes chunk
times meaningless): per prompt, the end-to-end time of the request minus that of the same request
with max_tokens 1 (prefill + first token; every prompt is in the prefix cache before timing
starts). Decode tokens/s = Σ (completion tokens - b) / Σ those differences, the b sequences
together; per sequence = that / b. The same difference of the decode worker's CPU time
(/proc/PID/stat utime + stime, 10 ms ticks) gives tokens per decode-worker CPU second, a figure
the machine's load does not move. Acceptance comes from the
decode worker's /metrics (epd_dspark_position_{drafted,accepted}_tokens_total, deltas over the
run of one batch size). Exits 1 when a greedy answer differs between the modes or a request
fails. Only the Python standard library is used.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

PROMPTS = [
    "Tell me about files.",
    "What is a list?",
    "Explain regular expressions.",
    "How do I install a package?",
    "What is a dictionary?",
    "Tell me about the network configuration.",
    "How does the import system work?",
    "Explain exceptions.",
    "What is a socket?",
    "Tell me about threads.",
    "How do I read a file?",
    "What is the shell?",
    "Explain the logging module.",
    "What is a tuple?",
    "Tell me about the package manager.",
    "How does string formatting work?",
]


def read_port(run_dir, name, key, timeout=60.0):
    path = os.path.join(run_dir, name + ".json")
    end = time.time() + timeout
    while time.time() < end:
        try:
            with open(path) as f:
                j = json.load(f)
            if key in j:
                return int(j[key])
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"no {key} port in {path}")


class Serve:
    def __init__(self, epd, model, dspark, extra):
        self.dir = tempfile.mkdtemp(prefix=f"dspark_bench_{dspark}_")
        cmd = [epd, "serve", "--model", model, "--data-dir", self.dir, "--http-port", "0",
               "--grpc-port", "0", "--dspark", dspark] + extra
        self.log = open(os.path.join(self.dir, "serve.out"), "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        end = time.time() + 120
        while time.time() < end:
            self.log.seek(0)
            if "epd serve: ready" in self.log.read():
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"epd serve exited {self.proc.returncode}; see {self.dir}")
            time.sleep(0.2)
        else:
            raise RuntimeError("epd serve did not become ready in 120 s")
        run = os.path.join(self.dir, "run")
        self.http = read_port(run, "epd-router", "http")
        self.metrics = read_port(run, "epd-decode-0", "metrics")
        self.decode_pid = None  # the epd-decode child: its CPU time is read from /proc
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv0 = f.read().split(b"\0")[0].decode()
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and argv0.endswith("/epd-decode"):
                self.decode_pid = int(pid)

    def decode_cpu_s(self):
        """User + system CPU seconds of the decode worker so far (clock ticks of /proc)."""
        with open(f"/proc/{self.decode_pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def scrape(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out = {}
    for m in re.finditer(r'^epd_dspark_position_(drafted|accepted)_tokens_total\{position="(\d+)"\}'
                         r" ([0-9.e+]+)$", text, re.M):
        out[(m.group(1), int(m.group(2)))] = float(m.group(3))
    for name in ("drafted", "accepted"):
        m = re.search(rf"^epd_dspark_{name}_tokens_total ([0-9.e+]+)$", text, re.M)
        out[(name, 0)] = float(m.group(1)) if m else 0.0
    return out


def chat(port, prompt, max_tokens, penalty, n=1):
    body = {"model": "epd-nano", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if n > 1:
        body["n"] = n
    if penalty:
        body["frequency_penalty"] = penalty
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.time()
    first = last = None
    texts, tokens = {}, 0
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            j = json.loads(data)
            if "error" in j:
                raise RuntimeError(f"request failed: {j['error']}")
            if j.get("usage"):
                tokens = j["usage"]["completion_tokens"]
            for ch in j.get("choices", []):
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    now = time.time()
                    first = first or now
                    last = now
                    i = ch.get("index", 0)
                    texts[i] = texts.get(i, "") + piece
    return {"texts": [texts.get(i, "") for i in range(n)], "tokens": tokens, "n": n, "t0": t0,
            "first": first, "last": last, "end": time.time()}


def measure(serve, prompt, b, max_tokens, penalty):
    """(decode tokens, decode seconds, result): one request with max_tokens 1 (prefill + first
    token) and one with max_tokens, both n = b, the prompt already in the prefix cache. Decode
    seconds = the difference of their end-to-end times; decode tokens = completion tokens of the
    full request minus the b first tokens."""
    c0 = serve.decode_cpu_s()
    probe = chat(serve.http, prompt, 1, penalty, b)
    c1 = serve.decode_cpu_s()
    full = chat(serve.http, prompt, max_tokens, penalty, b)
    c2 = serve.decode_cpu_s()
    return (max(full["tokens"] - b, 0), (full["end"] - full["t0"]) - (probe["end"] - probe["t0"]),
            full, (c2 - c1) - (c1 - c0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epd", default="build/epd")
    ap.add_argument("--model", default="models/epd-nano")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra `epd serve` argument (repeat)")
    ap.add_argument("--json")
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    modes = ("on", "off")
    report = {"max_tokens": a.max_tokens, "prompts": len(PROMPTS), "rounds": a.rounds,
              "frequency_penalty": a.frequency_penalty, "modes": {m: {} for m in modes}}
    answers = {}
    ok = True
    serves = {}
    try:
        for m in modes:
            serves[m] = Serve(a.epd, a.model, m, a.serve_arg)
        for m in modes:
            for p in PROMPTS:  # every prompt in the prefix cache before anything is timed
                chat(serves[m].http, p, 1, a.frequency_penalty)
        for b in batches:
            before = {m: scrape(serves[m].metrics) for m in modes}
            toks = {m: 0 for m in modes}
            span = {m: 0.0 for m in modes}
            cpu = {m: 0.0 for m in modes}
            for rnd in range(a.rounds):
                for k, p in enumerate(PROMPTS):
                    # Alternate which mode goes first: both see the same machine load.
                    order = modes if (rnd + k) % 2 == 0 else modes[::-1]
                    for m in order:
                        t, d, r, c = measure(serves[m], p, b, a.max_tokens, a.frequency_penalty)
                        toks[m] += t
                        span[m] += d
                        cpu[m] += c
                        for text in r["texts"]:
                            prev = answers.setdefault(p, text)
                            if prev != text:
                                ok = False
                                print(f"MISMATCH ({m}, batch {b}) {p!r}:\n  {prev!r}\n"
                                      f"  {text!r}")
            for m in modes:
                after = scrape(serves[m].metrics)
                acc = []
                for j in range(1, 6):
                    d = after.get(("drafted", j), 0) - before[m].get(("drafted", j), 0)
                    n = after.get(("accepted", j), 0) - before[m].get(("accepted", j), 0)
                    acc.append({"position": j, "drafted": int(d), "accepted": int(n),
                                "rate": round(n / d, 4) if d else None})
                drafted = after[("drafted", 0)] - before[m][("drafted", 0)]
                accepted = after[("accepted", 0)] - before[m][("accepted", 0)]
                sp = span[m]
                rec = {"decode_tokens": toks[m], "decode_seconds": round(sp, 3),
                       "decode_tok_s": round(toks[m] / sp, 2) if sp > 0 else None,
                       "per_sequence_tok_s": round(toks[m] / b / sp, 2) if sp > 0 else None,
                       "decode_cpu_seconds": round(cpu[m], 3),
                       "decode_tok_per_cpu_s": round(toks[m] / cpu[m], 1) if cpu[m] > 0 else None,
                       "drafted": int(drafted), "accepted": int(accepted),
                       "acceptance": round(accepted / drafted, 4) if drafted else None,
                       "per_position": acc}
                report["modes"][m][str(b)] = rec
                print(f"dspark {m:3s} batch {b}: {rec['decode_tok_s']} decode tok/s "
                      f"({toks[m]} tokens in {sp:.3f} s; per sequence "
                      f"{rec['per_sequence_tok_s']}; {rec['decode_tok_per_cpu_s']} tokens per "
                      f"decode-worker CPU second); drafted {int(drafted)}, accepted "
                      f"{int(accepted)}; per position (accepted/drafted) "
                      + " ".join(f"{x['position']}:{x['accepted']}/{x['drafted']}" for x in acc),
                      flush=True)
            on, off = report["modes"]["on"][str(b)], report["modes"]["off"][str(b)]
            if on["decode_tok_s"] and off["decode_tok_s"]:
                report["modes"]["on"][str(b)]["vs_off"] = round(
                    on["decode_tok_s"] / off["decode_tok_s"], 3)
                print(f"batch {b}: on/off = {on['decode_tok_s'] / off['decode_tok_s']:.3f} (wall), "
                      f"{(on['decode_tok_per_cpu_s'] or 0) / (off['decode_tok_per_cpu_s'] or 1):.3f}"
                      " (decode-worker CPU time)", flush=True)
    finally:
        for sv in serves.values():
            sv.stop()
    report["greedy_identical"] = ok
    report["answers"] = answers
    print("greedy outputs identical across modes and batch sizes" if ok else "FAIL: outputs differ")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
