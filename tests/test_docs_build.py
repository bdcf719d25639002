"""The docs site builds with `mkdocs build --strict` (broken links, pages left out of the nav and absolute links are
errors: see mkdocs.yml), every page under docs/ is in the nav, and no page (nor the README) names a repository file
that the checkout lacks."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"


def _need_mkdocs() -> None:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install mkdocs): the docs site cannot be built here")


def test_docs_build_strict(tmp_path):
    _need_mkdocs()
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site"),
                        "-f", str(MKDOCS_YML)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert (tmp_path / "site" / "index.html").is_file()


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [p for v in node.values() for p in _nav_pages(v)]
    if isinstance(node, list):
        return [p for v in node for p in _nav_pages(v)]
    return []


def test_every_page_is_in_the_nav():
    _need_mkdocs()
    import yaml                                    # PyYAML comes with mkdocs
    cfg = yaml.safe_load(MKDOCS_YML.read_text())
    assert cfg.get("strict") is True and cfg.get("docs_dir") == "docs"
    nav = _nav_pages(cfg["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(p for p in nav if p.endswith(".md"))) == pages
    assert len(nav) == len(set(nav)), "a page is listed twice in the nav"


# --- file references ------------------------------------------------------------------------------------------------
# A token inside backticks (inline or fenced) that looks like a path of this repository: one with a "/" that starts
# at a top-level entry of the checkout or ends in a source/doc extension (resolved against the repository root, or
# against the page for ./ and ../), or, in inline code, a bare file name with a source/doc extension (it must exist
# somewhere in the checkout). Placeholders and wildcards (<...>, {...}, *, ..., NAME, DIR), absolute paths and URLs
# are not paths.
_EXTS = {"py", "pyi", "sh", "c", "h", "cu", "cuh", "md", "toml", "cfg", "ini", "yml", "yaml", "txt", "json", "png"}
_BARE_EXTS = {"py", "pyi", "sh", "c", "h", "cu", "cuh", "md", "toml", "yml", "yaml"}
_SKIP_DIRS = {".git", "site", "node_modules", "__pycache__", ".venv", "venv", ".whl", ".pytest_cache", "build",
              "dist"}
_FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9]*$")
_CONVENTIONAL = {"README", "LICENSE", "CHANGELOG", "CHANGES", "CONTRIBUTING", "NOTICE", "AUTHORS", "SECURITY"}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _code_texts(text: str) -> list[tuple[str, bool]]:
    """(code, inline) for every fenced block and inline code span."""
    fenced = [(c, False) for c in _FENCE.findall(text)]
    return fenced + [(c, True) for c in _SPAN.findall(_FENCE.sub("", text))]


def _candidates(code: str):
    for tok in re.split(r"[\s,;()=\"'|]+", code):
        tok = tok.split("::")[0].split("#")[0]
        tok = re.sub(r":[0-9][0-9,-]*$", "", tok).rstrip(".:")          # file.py:125-127, a sentence's full stop
        if not tok or "/" not in tok and "." not in tok:
            continue
        if any(c in tok for c in "*?<>{}[]$~%@!&\\") or "..." in tok or "://" in tok or tok.startswith(("/", "-")):
            continue
        yield tok


def _is_placeholder(parts: list[str]) -> bool:
    """A segment with an upper-case word (DIR, OUTDIR/..., test_NAME.py), other than README-style file names."""
    words = [w for p in parts for w in re.split(r"[_.\-]", p.rsplit(".", 1)[0] if "." in p else p)]
    return any(_PLACEHOLDER.match(w) and len(w) > 1 and w not in _CONVENTIONAL for w in words)


def _all_names() -> set[str]:
    names = set()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.endswith((".egg-info", "-venv"))]
        names.update(filenames)
    return names


def broken_file_references() -> list[str]:
    top = {p.name for p in ROOT.iterdir()}
    names = None
    broken = []
    for page in _pages():
        for code, inline in _code_texts(page.read_text()):
            for tok in _candidates(code):
                parts = [p for p in tok.split("/") if p]
                if not parts:
                    continue
                ext = parts[-1].rsplit(".", 1)[-1] if "." in parts[-1] else ""
                if "/" in tok:
                    if tok.startswith(("./", "../")):
                        target = (page.parent / tok).resolve()
                    elif parts[0] in top or ext in _EXTS:
                        target = ROOT / tok
                    else:
                        continue
                    if target.exists() or _is_placeholder(parts):
                        continue
                elif inline and ext in _BARE_EXTS and not parts[-1].startswith("."):
                    # (bare names in fenced blocks are the user's own files: `python app.py`)
                    names = _all_names() if names is None else names
                    if parts[-1] in names or _is_placeholder(parts):
                        continue
                else:
                    continue
                broken.append(f"{page.relative_to(ROOT).as_posix()}: {tok}")
    return sorted(set(broken))


def test_pages_name_only_files_the_repository_has():
    broken = broken_file_references()
    assert not broken, "pages name files the checkout lacks:\n" + "\n".join(broken)


if __name__ == "__main__":                    # list the broken references: python tests/test_docs_build.py
    print("\n".join(broken_file_references()) or "none")
