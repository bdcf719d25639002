"""The README's command blocks run as written, in their order, in one empty directory, offline (a network namespace
of their own where the machine allows one, and HF_HUB_OFFLINE=1 always), as a new user runs them. Left to others:
install lines (CI's fresh venv runs them: .ci/run), the test command itself, and blocks that need a GPU or a vLLM
venv (`vllm serve`)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
NOT_HERE = ("pip ", "python3 -m venv", "python3 -m pytest", "vllm-cpu/", "GDS_GATHER_VLLM=1 ")
GPU_SECTION = "## Run on a GPU"


def blocks() -> list[tuple[str, str, str]]:
    """(section heading, language, body) of every fenced block, in order."""
    out, heading = [], ""
    for m in re.finditer(r"^(## [^\n]*)$|^```(\w*)\n(.*?)^```$", README.read_text(), re.M | re.S):
        if m.group(1):
            heading = m.group(1)
        else:
            out.append((heading, m.group(2), m.group(3)))
    return out


def commands() -> list[tuple[str, str]]:
    """("sh", command) for each shell command and ("python", source) for each Python block the test runs."""
    out, seen = [], set()
    for heading, lang, body in blocks():
        if heading.startswith(GPU_SECTION) or "<!--" in body:
            continue
        if lang == "python":
            out.append(("python", body))
            continue
        if lang not in ("", "bash", "sh"):
            continue
        for line in body.splitlines():
            for part in line.split(" && "):
                cmd = re.sub(r"\s+#.*$", "", part).strip()
                if cmd.startswith("gds-gather") and not cmd.startswith(NOT_HERE) and cmd not in seen:
                    seen.add(cmd)
                    out.append(("sh", cmd))
    return out


def _offline_prefix() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n"]
    return []


def test_the_readme_has_the_blocks_this_test_runs():
    kinds = [k for k, _ in commands()]
    cmds = [c for k, c in commands() if k == "sh"]
    assert kinds.count("python") >= 2, kinds                     # the quickstart and the transformers example
    assert any(c.startswith("gds-gather make-model --hf") for c in cmds), cmds
    assert any(c.startswith("gds-gather prefill") for c in cmds), cmds


@pytest.mark.slow
def test_readme_commands_run_as_written_offline(tmp_path):
    pytest.importorskip("transformers")
    bindir = str(Path(sys.executable).parent)        # this venv's gds-gather console script
    if not Path(bindir, "gds-gather").exists():
        pytest.skip("the gds-gather console script is not installed beside this Python")
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "GDS_GATHER_CACHE_DIR": str(tmp_path / "cache")}
    work = tmp_path / "work"
    work.mkdir()
    offline = _offline_prefix()
    for kind, text in commands():
        argv = (offline + ["bash", "-c", text] if kind == "sh" else offline + [sys.executable, "-c", text])
        r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{kind} block failed:\n{text}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n" \
                                  f"{r.stderr[-3000:]}"
    assert (work / "q.gguf").is_file() and (work / "tiny-gemma4" / "tokenizer.json").is_file()


def test_relative_links_resolve():
    root = README.parent
    pages = [README, *sorted((root / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(root)} -> {target}")
    assert not broken, broken
