"""What every bench shares: sizes, the machine-facts header, going cold, medians, ratios, the JSON file."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import sys
import subprocess
from pathlib import Path

import numpy as np

from ..cache.rowcache import AUTO_MEMORY_SHARE
from ..io import measure, memory
from ..prefill.run import MAX_UBATCH
from ..units import int_in
from ..units import fit, parse_size
from ..config import Config
from ..model.synth import MAX_ROWS
from ..prefill.prompts import MAX_TOKENS

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
HOST_BACKENDS = ("direct", "pread", "mmap", "readahead", "resident")

# argparse types of the benches' counts: each at least 1, so 0 is refused on the command line (one line, exit 2)
# before anything is built, not taken as "the default"
COUNT = int_in(1, 2**31 - 1)
ROWS = int_in(1, MAX_ROWS)
TOKENS = int_in(1, MAX_TOKENS)
UBATCH = int_in(1, MAX_UBATCH)


def short_num(x: float) -> str:
    """Compact figure for plot labels: 95.7k, 6.8M, 1.23."""
    if not math.isfinite(x):
        return ""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def out_dir(a, cfg: Config) -> Path:
    """Where a bench's outputs go (JSON, plots): --out, else the cache directory's bench/ (never the checkout)."""
    return Path(a.out) if getattr(a, "out", None) else Path(cfg.cache_dir) / "bench"


def data_dir(a, cfg: Config) -> Path:
    """Where made files live (storage test files, built tables; made once, reused): --dir, else out_dir."""
    return Path(a.dir) if getattr(a, "dir", None) else out_dir(a, cfg)


DROP_CACHES_HELP = ("echo 3 > /proc/sys/vm/drop_caches before each cold pass: empties the page cache of the WHOLE "
                    "machine (every process's files; root only). Default: evict only the bench's own files")


def cold_method(a) -> str:
    """The header's words for how a cold pass goes cold."""
    if getattr(a, "drop_caches", False):
        return "cold = " + DROP_CACHES_HELP.split(":")[0] + " (the whole machine's page cache, root only, asked for)"
    return "cold = the bench's own files evicted (fsync + POSIX_FADV_DONTNEED; mincore checks it; no other file)"


def go_cold(path, drop: bool = False, span: tuple[int, int] | None = None) -> str:
    """Make `path` cold: evict just this file (default), or, only when asked (--drop-caches), drop the whole
    machine's page cache. Checks with mincore (over `span` = (offset, length), e.g. a table's data, when given)
    and returns what was done, saying so when pages stayed cached."""
    if drop and measure.drop_caches():
        how = "drop_caches (whole machine)"
    else:
        how = ("drop_caches refused (not root): " if drop else "") + "POSIX_FADV_DONTNEED on the file"
        measure.evict_file(path)
    left = measure.resident_bytes(path, *(span or (0, None)))
    if left > 0:
        how += (f"; NOT fully cold: {left / MiB:.2f} MiB still cached (pages of a live mapping stay, e.g. an open "
                "Table's metadata mapping of the file's head)")
    return how


def block_device(path, sysfs="/sys") -> str:
    """The block device under `path`, e.g. 'nvme0n1 (nvme, SAMSUNG MZQL23T8HCLS)' or 'vda (virtio)' (sysfs: where
    sysfs is mounted)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return "?"
    base = Path(sysfs) / f"dev/block/{os.major(dev)}:{os.minor(dev)}"
    if not base.exists():
        return f"no block device (device {os.major(dev)}:{os.minor(dev)}: tmpfs, overlay or network)"
    real = base.resolve()
    if (real / "partition").exists():
        real = real.parent
    name, s = real.name, str(real)
    kind = ("nvme" if name.startswith("nvme") else "virtio" if "/virtio" in s else "device-mapper"
            if name.startswith("dm-") else "md raid" if name.startswith("md") else "loop" if name.startswith("loop")
            else "zram" if name.startswith("zram") else "scsi/sata" if name.startswith("sd") else "")
    model = ""
    for f in (real / "device" / "model", real / "device" / "device" / "model"):
        try:
            model = f.read_text().strip()
            break
        except OSError:
            pass
    what = ", ".join(x for x in (kind, model) if x)
    return f"{name} ({what})" if what else name


def fio_version() -> str:
    fio = shutil.which("fio")
    if not fio:
        return "not installed"
    try:
        return subprocess.run([fio, "--version"], capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def gpu_facts(cfg: Config) -> dict:
    """GPU, driver and GPU-direct storage state (imports cupy/kvikio only where a GPU platform is detected)."""
    from ..platform import detect
    plat = detect(cfg.platform)
    d = {"platform": plat.kind, "platform_reason": plat.reason, "gpu": plat.device or "none",
         "driver": "n/a", "gds": "n/a (no GPU)"}
    if plat.kind == "cpu":
        return d
    parts = []
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", f.read())
            if m:
                parts.append(f"NVIDIA {m.group(1)}")
    except OSError:
        pass
    try:
        import cupy
        v = cupy.cuda.runtime.driverGetVersion()
        parts.append(f"{'HIP' if cupy.cuda.runtime.is_hip else 'CUDA'} {v // 1000}.{v % 1000 // 10}")
    except Exception as e:  # a broken driver is a fact too
        parts.append(f"version unknown ({type(e).__name__})")
    d["driver"] = ", ".join(parts)
    if plat.kind == "discrete":
        from ..backends import gds_state
        ok, real, why = gds_state()
        d["gds"] = ("real GPU-direct storage" if real else "compat mode" if ok else "unavailable") + f": {why}"
    else:
        d["gds"] = f"n/a on a {plat.kind} platform"
    return d


def bench_facts(path, cfg: Config) -> dict:
    f = measure.machine_facts(path)
    f.update(gpu_facts(cfg))
    io = measure.ReadCounter(path)
    f.update(device=block_device(path), fio=fio_version(), delivered_method=io.stop()["delivered_method"],
             device_method=io.device_method)
    lim = memory.limits(cfg.memory_root)
    f.update(memory_available_bytes=memory.available(lim), memory_source=memory.source(lim),
             memory_cgroup_limit_bytes=lim.cgroup_limit)
    return f


def apply_cache_option(cfg: Config, cache) -> tuple[Config, str]:
    """--cache BYTES -> Config(cache_bytes=...); returns the header's words."""
    if cache is not None:
        cfg = cfg.with_(cache_bytes=parse_size(cache))
    size = (f"{cfg.cache_bytes:,} B" if cfg.cache_bytes >= 0 else
            f"auto ({cfg.cache_bytes}: the build's default, sized per table; see each pass's cache_budget_bytes)")
    return cfg, f"row cache: budget {size}" + (" (--cache)" if cache is not None else
                                               " (GDS_GATHER_CACHE_BYTES or the default)")


def print_header(name: str, f: dict, extra=(), quick: bool = False) -> None:
    lines = [f"gds-gather bench {name}"]
    if quick:
        lines.append("quick    a smoke run: tiny tables, short runs; they do not measure the device, so no "
                     "PASS/MISS verdicts")
    lines += [f"machine  {f['cpu']}, {f['cores']} cores, {f['mem_GiB']} GiB RAM, Linux {f['kernel']}, "
              f"Python {f['python']}, numpy {f['numpy']}",
              memory_line(f),
              f"gpu      {f['gpu']}; driver {f['driver']}; GDS {f['gds']}",
              f"platform {f['platform']}: {f['platform_reason']}",
              f"storage  {f['file']} ({f['file_GiB']} GiB): {f['filesystem']} on {f['device']}, "
              f"{f['logical_block']} B logical blocks",
              f"bytes    delivered = {f.get('delivered_method') or 'n/a (no /proc/self/io here)'}",
              f"bytes    device = "
              f"{f.get('device_method') or 'n/a (no block device under the file: tmpfs, overlay or network)'}"]
    lines += [line for line in extra if line]
    lines.append(f"tools    fio: {f['fio']}")
    for line in lines:
        print(fit("# " + line, "#          "))
    sys.stdout.flush()


def memory_line(f: dict) -> str:
    """The header's memory limit: what this process may use and where that came from (the budgets follow it)."""
    avail = f.get("memory_available_bytes")
    return (f"memory   {'unknown' if avail is None else f'{avail / GiB:.1f} GiB'} available to this process "
            f"({f.get('memory_source', 'not read')}); the row cache's auto budget takes at most "
            f"1/{AUTO_MEMORY_SHARE} of it")


def machine_title(f: dict) -> str:
    cpu = re.sub(r"\((R|TM)\)|\bCPU\b|\s@.*$", "", f.get("cpu", "?"))
    cpu = re.sub(r"\s+", " ", cpu).strip()
    gpu = f.get("gpu") if f.get("gpu") not in (None, "", "none") else "no GPU"
    return f"{cpu} ({f.get('cores')} cores), {gpu}; {f.get('filesystem', '?')} on {f.get('device', '?')}"


def median(values) -> float:
    """The real median: the middle value, or the mean of the middle two for an even count."""
    return float(statistics.median(values)) if len(values) else math.nan


def _is_num(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def median_run(runs: list[dict], key: str) -> dict:
    """One record for repeated runs: every numeric figure is its median over the runs (mean of the middle two
    for an even count), nested dicts figure by figure; text comes from the first run; `key`_all lists `key`."""
    def merge(recs):
        out = dict(recs[0])
        for k, v in recs[0].items():
            vals = [r.get(k) for r in recs]
            if all(_is_num(x) for x in vals):
                m = median(vals)
                ints = all(isinstance(x, (int, np.integer)) for x in vals)
                out[k] = int(m) if ints and m == int(m) else m      # counts stay ints where they can
            elif all(isinstance(x, dict) for x in vals):
                out[k] = merge(vals)
        return out
    best = merge(runs)
    best[key + "_all"] = [r[key] for r in runs]
    best["n_runs"] = len(runs)
    return best


def target(a, value):
    """A ratio's target, or None under --quick (a smoke run's figures say nothing about the device)."""
    return None if getattr(a, "quick", False) else value


def ratio_line(name: str, a, b, target=None, note: str = "") -> str:
    if not a or not b:
        return fit(f"  {name}: n/a")
    x = a / b
    verdict = "" if target is None else ("  PASS" if x >= target else "  MISS") + f" (target >= {target})"
    return fit(f"  {name} = {x:.2f}x{verdict}{note}")


def jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    return str(x)


def write_result(name: str, result: dict, a, directory: Path, plot) -> dict:
    """Write the JSON file, draw the plot (--plot alone: bench_NAME.png beside the JSON), print the JSON line."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (a.json_name or f"bench_{name}.json")
    if a.plot is not None:
        png = Path(a.plot) if a.plot else path.with_suffix(".png")
        try:
            plot(result, png)
            result["plot"] = str(png)
            print(f"plot: {png}")
        except ImportError as e:
            print(f"plot: skipped, matplotlib is not installed (pip install 'gds-gather[plot]'): {e}")
    result["json_file"] = str(path)
    path.write_text(json.dumps(result, indent=1, default=jsonable))
    print(f"json: {path}")
    if a.json:
        print(json.dumps(result, default=jsonable))
    return result
