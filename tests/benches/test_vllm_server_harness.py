"""benches/vllm_server.py without vLLM: a stand-in server (a stdlib HTTP server that answers like vLLM's OpenAI
server and starts a child of its own) checks the harness: readiness, the client's token ids, time to first token
and tokens/s, the process tree's RSS, a server that exits before it is ready (its status, its log, no port), one
that never gets ready (a deadline), and that stopping leaves no process of the tree alive. A few seconds."""
from __future__ import annotations

import stat
import sys
import time

import pytest

from gds_gather.benches import vllm_server as vs

FAKE = r'''
import http.server, json, os, subprocess, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
mode = os.environ.get("FAKE_MODE", "")
print("INFO fake server starting", flush=True)
if mode == "exit":
    print("ERROR gds_gather: a table that does not fit; the server does not start", flush=True)
    time.sleep(0.5)
    sys.exit(3)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _json(self, obj, status=200):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._json({}, 503 if mode == "never" else 200)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0.0 and body["return_token_ids"] and body["ignore_eos"]
        n = body["max_tokens"]
        if self.path == "/v1/chat/completions":
            ids = [len(body["messages"][0]["content"]) + i for i in range(n)]
            return self._json({"choices": [{"message": {"content": "ok"}, "token_ids": ids}]})
        ids = [sum(body["prompt"]) + i for i in range(n)]
        if not body.get("stream"):
            return self._json({"choices": [{"token_ids": ids}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(0.2)                                  # the prefill
        for t in ids:
            self.wfile.write(b"data: " + json.dumps({"choices": [{"token_ids": [t]}]}).encode() + b"\n\n")
            self.wfile.flush()
            time.sleep(0.01)
        self.wfile.write(b"data: [DONE]\n\n")


http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture()
def fake_python(tmp_path):
    """An executable standing in for vLLM's python: it ignores `-m MODULE` and runs FAKE."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    p = tmp_path / "python"
    p.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_server_answers_and_stops_with_its_children(fake_python, tmp_path):
    srv = vs.Server(tmp_path / "model", fake_python, tp=2, log=tmp_path / "log")
    assert srv.args[srv.args.index("--tensor-parallel-size") + 1] == "2" and "--enforce-eager" in srv.args
    with srv:
        assert 0 < srv.wait_ready(30) < 30 and srv.port_opened
        model = str(tmp_path / "model")
        assert vs.complete(srv.port, model, [[1, 2], [10]], 3) == [[3, 4, 5], [10, 11, 12]]
        assert vs.chat(srv.port, model, [{"role": "user", "content": "abcd"}], 2) == {"text": "ok",
                                                                                       "token_ids": [4, 5]}
        one = vs.stream(srv.port, model, [7], 5)
        assert one["tokens"] == [7, 8, 9, 10, 11] and 0.2 <= one["ttft_s"] < one["total_s"]
        out = vs.load(srv.port, model, [[1], [2], [3], [4]], 5, concurrency=2)
        assert out["tokens"] == [[i + j for j in range(5)] for i in (1, 2, 3, 4)]
        assert out["requests"] == 4 and out["concurrency"] == 2 and out["ttft_s"] >= 0.2
        assert out["tok_per_s"] == pytest.approx(20 / out["wall_s"])
        assert out["wall_s"] < 2 * 4 * one["total_s"]          # two in flight: about half the serial time
        tree = vs.processes(srv.proc.pid)
        assert [p["pid"] for p in tree][0] == srv.proc.pid and len(tree) == 2      # the server and its child
        assert tree[1]["ppid"] == srv.proc.pid and all(p["rss"] > 0 for p in tree)
        assert sorted(vs.session(srv.proc.pid)) == sorted(p["pid"] for p in tree)
        pids = [p["pid"] for p in tree]
    assert srv.proc is None and all(_gone(p) for p in pids)     # SIGTERM ends the server; its child too
    assert "fake server starting" in srv.log()


def test_server_that_exits_before_it_is_ready(fake_python, tmp_path):
    srv = vs.Server(tmp_path, fake_python, pp=2, env={"FAKE_MODE": "exit"}, log=tmp_path / "log")
    assert srv.args[srv.args.index("--compilation-config") + 1] == vs.PP_COMPILATION
    with srv, pytest.raises(vs.ServerExited) as e:
        srv.wait_ready(30)
    assert e.value.rc == 3 and not e.value.port_opened
    assert "ERROR gds_gather: a table that does not fit; the server does not start" in e.value.log


def test_server_that_never_gets_ready_is_stopped(fake_python, tmp_path):
    srv = vs.Server(tmp_path, fake_python, env={"FAKE_MODE": "never"}, log=tmp_path / "log")
    t0 = time.perf_counter()
    with srv, pytest.raises(TimeoutError, match="did not answer /health within 2 s"):
        sid = srv.start().proc.pid if srv.proc is None else srv.proc.pid
        srv.wait_ready(2)
    assert srv.port_opened and time.perf_counter() - t0 < 20          # it listened, but never answered 200
    assert vs.session(sid) == []


def test_free_port_is_free():
    import socket
    port = vs.free_port()
    with socket.socket() as s:
        s.bind((vs.HOST, port))
