"""The HTTP server under load: concurrent clients (the official `openai` client), each
sending requests one after another to a live `python -m spel_mlx.server`.  Every
request must complete or get 429; the latency percentiles are recorded, not judged.

    python bench/server_load.py [--clients 16] [--requests 4] [--max-tokens 32]
                                [--queue-size 8] [--json docs/server_load.json]

Starts the server on a free loopback port (the shipped model, greedy requests), runs
the load, stops the server, writes the JSON (docs/server.md, "Under load").
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench.common import machine_info, write_json_atomic  # noqa: E402

PROMPTS = ["It is a truth universally acknowledged, that", "And God said unto Moses,",
           "Elizabeth was", "In the beginning"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`python -m spel_mlx.server ARGS` on a free loopback port, up when constructed."""

    def __init__(self, *args, log_dir: str, timeout: float = 120):
        args = [str(a) for a in args]
        self.key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"server-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spel_mlx.server", "--port", str(self.port), *args],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                self.health()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the server did not come up in {timeout} s:\n{self.log()}")
                time.sleep(0.1)

    def health(self, key: str | None = None) -> dict:
        """/health, with the server's key (its counts and recent requests are shown only then)."""
        key = key or self.key
        req = urllib.request.Request(self.url + "/health", headers={"Authorization": f"Bearer {key}"} if key else {})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.load(r)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        """Ctrl-C, as a person would stop it; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def percentiles(xs) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=20, method="inclusive") if len(xs) > 1 else [xs[0]] * 19
    return {"n": len(xs), "p50": round(statistics.median(xs), 4), "p95": round(q[18], 4),
            "max": round(xs[-1], 4)}


def run_load(url: str, api_key: str | None = None, clients: int = 16, requests: int = 4,
             max_tokens: int = 32, timeout: float = 120) -> dict:
    """`clients` threads, each with its own openai client, `requests` requests each."""
    import openai

    results = []          # (status, seconds, completion tokens)
    lock = threading.Lock()

    def client(i):
        c = openai.OpenAI(base_url=url + "/v1", api_key=api_key or "none", max_retries=0, timeout=timeout)
        for j in range(requests):
            t0 = time.perf_counter()
            try:
                r = c.completions.create(model="m", prompt=PROMPTS[(i + j) % len(PROMPTS)],
                                         max_tokens=max_tokens, temperature=0)
                status, tokens = 200, r.usage.completion_tokens
            except openai.APIStatusError as e:
                status, tokens = e.status_code, 0
            except Exception as e:       # timeouts, refused connections: reported, never hidden
                status, tokens = f"{type(e).__name__}: {e}", 0
            with lock:
                results.append((status, time.perf_counter() - t0, tokens))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [s for st, s, _ in results if st == 200]
    return {"clients": clients, "requests_per_client": requests, "max_tokens": max_tokens,
            "sent": len(results), "completed": len(done),
            "rejected_429": sum(st == 429 for st, _, _ in results),
            "other": [st for st, _, _ in results if st not in (200, 429)],
            "tokens": sum(n for _, _, n in results), "wall_s": round(wall, 3),
            "latency_completed_s": percentiles(done),
            "latency_429_s": percentiles([s for st, s, _ in results if st == 429])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--queue-size", type=int, default=8)
    ap.add_argument("--json", default=os.path.join(REPO, "docs", "server_load.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as logs:
        srv = LiveServer("--queue-size", args.queue_size, log_dir=logs)
        try:
            res = run_load(srv.url, clients=args.clients, requests=args.requests, max_tokens=args.max_tokens)
            res["server_alive"] = srv.alive()
            res["server_counts"] = srv.health()["counts"]
        finally:
            srv.stop()
    res["queue_size"] = args.queue_size
    res["loadavg_1_5_15_min"] = os.getloadavg()     # other work on the machine meanwhile
    res["machine"] = machine_info()
    write_json_atomic(args.json, res)
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=1))
    return 0 if not res["other"] else 1


if __name__ == "__main__":
    sys.exit(main())
