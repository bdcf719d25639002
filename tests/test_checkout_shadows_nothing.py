"""The checkout's root on sys.path (``python -m pytest``, a script run from the root) makes nothing but gds_gather
resolve into the checkout: a folder such as ``kernels/`` must not shadow an installed distribution of that name
(Hugging Face's ``kernels``, which transformers imports)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = r"""
import importlib.metadata as md, importlib.util, json, os, sys
root = os.path.realpath(sys.argv[1])
names = set(md.packages_distributions())
names |= {e.name for e in os.scandir(root) if e.is_dir() and e.name.isidentifier()}
inside = {}
for name in sorted(names):
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        continue
    if spec is None:
        continue
    places = [spec.origin] if spec.origin else []
    places += list(spec.submodule_search_locations or [])
    hits = [p for p in places if p and os.path.realpath(p).startswith(root + os.sep)]
    if hits:
        inside[name] = {"regular": spec.origin is not None, "where": hits}
print(json.dumps(inside))
"""


def test_no_folder_of_the_root_but_gds_gather_is_a_package():
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert packages == ["gds_gather"], packages


def test_only_gds_gather_resolves_into_the_checkout_from_its_root():
    # '' first on sys.path, as `python -c` and `python -m` from the root put it
    out = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT)], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    inside = json.loads(out.stdout)
    regular = {name for name, hit in inside.items() if hit["regular"]}
    assert regular == {"gds_gather"}, inside
    # a folder without __init__.py is at most a namespace portion, which any installed package of the name outranks
    from importlib.metadata import packages_distributions
    installed = set(packages_distributions())
    shadowed = {name for name in inside if name != "gds_gather" and name in installed}
    for name in shadowed:
        assert not inside[name]["regular"], (name, inside[name])
    if "kernels" in installed:   # the case that broke: transformers' `kernels` import from the root
        probe = "import kernels, os, sys; print(os.path.realpath(kernels.__file__ or ''))"
        where = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
        assert not where.startswith(str(ROOT.resolve()) + "/"), where
