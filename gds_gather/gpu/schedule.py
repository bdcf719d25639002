"""The host side of the double-buffered prefill: stage, release, launch, slot reuse, and what happens on an error.

Ordering contract with the device (GpuPrefill implements it with CUDA graphs and a pinned flag per slot; the
tests implement it with a thread that plays the GPU stream):

- ``slot_free(k, s)``: block until the device is done with slot ``s`` (ubatch k-2's work), then collect it;
- ``launch(n, s)``: queue ubatch work on the device's one stream. In the gated modes ("overlap", "staged") the
  queued work first waits, on the device, until the host sets flag ``s``; it then reads slot ``s``'s buffers
  and re-arms the flag to 0 itself. "eager" launches are not gated;
- ``release(s)``: host writes flag ``s`` = 1 after the slot's staging is complete (a barrier first);
- ``scrub(s)``: host makes slot ``s``'s index buffers harmless (zeros: every offset and id in bounds), for work
  that is released without its staging;
- ``done(k, s)``: mark ubatch k's completion in slot s (an event); ``drain()``: wait for everything queued;
  ``rearm()``: host resets every flag to 0 (called only when nothing is queued).

Modes: "overlap" launches ubatch k before staging it, so the host reads k while the device computes k-1 and then
waits for k's flag; "staged" stages first, releases, then launches (cuFile reads must complete before the
graph: they cannot be captured); "eager" stages, then launches ungated.

On any exception in the host half (a ReadError, a bad token id, a KeyboardInterrupt, a CUDA error), the slot
whose launched work waits on its flag is scrubbed and released, the stream is drained and the flags re-armed,
so nothing is left blocked; then the original exception propagates, with a note naming the ubatch.
"""
from __future__ import annotations

import logging
import math

from ..errors import StagingCapacityError

log = logging.getLogger(__name__)

MODES = ("overlap", "staged", "eager")


def graph_mode(requested: bool, platform_kind: str) -> tuple[bool, str]:
    """(capture CUDA graphs?, why) for the GPU prefill on this platform."""
    if not requested:
        return False, "eager: graph=False (--no-graph)"
    if platform_kind == "rocm":
        return False, ("eager on ROCm: the captured wait on the host flag is a CUDA driver call "
                       "(cuStreamWaitValue32); HIP's hipStreamWaitValue32 path is not built")
    return True, "CUDA graph per (ubatch size, slot)"


def staging_bound(n_ids: int, row_bytes: int, align: int, max_gap: int = 0, max_waste: float | None = None) -> int:
    """The most window-staging bytes a plan of `n_ids` row ids can need (planner.windows' rules).

    A unique row touches at most ceil(row_bytes / align) + 1 aligned blocks; windows are unions of those blocks
    plus bridged gaps, and each bridge (at most one per unique row) adds at most min(max_gap, max_waste x
    row_bytes) bytes of whole blocks. The window-size cap only splits windows, so it cannot add bytes.
    """
    if n_ids <= 0:
        return 0
    per_row = (-(-row_bytes // align) + 1) * align
    gap = max(0, int(max_gap))
    if max_waste is not None and math.isfinite(max_waste):
        gap = min(gap, int(max_waste * row_bytes))
    gap -= gap % align                                   # a bridged gap is whole unread blocks
    return n_ids * (per_row + gap)


def staging_bound_for(table, n_ids: int, align: int | None = None) -> int:
    """staging_bound with the table's geometry (alignment: `align`, default the table's) and its Config's window
    settings."""
    cfg = table.config
    return staging_bound(n_ids, table.row_bytes, align or table.align, getattr(cfg, "max_gap", 0),
                         getattr(cfg, "max_waste", None))


def check_fits(plan, capacity: int, odirect: bool, what: str = "captured staging") -> int:
    """Bytes the plan needs in staging (windows with O_DIRECT, compact rows otherwise); StagingCapacityError when
    that exceeds `capacity`."""
    need = plan.window_bytes if odirect else plan.n_unique * plan.row_bytes
    if need > capacity:
        raise StagingCapacityError(
            f"this ubatch's plan needs {need:,} B of staging ({plan.n_unique:,} unique rows in {plan.n_windows:,} "
            f"windows) but the {what} holds {capacity:,} B; a CUDA graph keeps its buffers' addresses, so it is "
            "refused before any read (lower GDS_GATHER_MAX_GAP or the ubatch size)")
    return need


def run_ubatches(ubatches, stage, device, mode: str, after=None) -> None:
    """Run every ubatch through `stage(tok, s)` (host) and `device` (see the module docstring).

    after(k, tok) runs once ubatch k is launched (collecting outputs, progress). Any exception leaves the device
    drained and its flags re-armed before it propagates.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    n = len(ubatches)
    pending = None               # the slot whose launched, gated work still waits for its flag
    k, phase = -1, "start"
    try:
        for k, tok in enumerate(ubatches):
            s = k % 2
            phase = "waiting for the slot"
            device.slot_free(k, s)
            if mode == "overlap":
                pending = s                  # before launch: an interrupt right after it must still release s
                phase = "launching"
                device.launch(tok.size, s)
                phase = "staging (reads)"
                stage(tok, s)
                phase = "releasing"
                device.release(s)
                pending = None
            elif mode == "staged":
                phase = "staging (reads)"
                stage(tok, s)
                phase = "releasing"
                device.release(s)
                phase = "launching"
                device.launch(tok.size, s)
            else:
                phase = "staging (reads)"
                stage(tok, s)
                phase = "launching"
                device.launch(tok.size, s)
            device.done(k, s)
            if after is not None:
                phase = "collecting"
                after(k, tok)
        phase = "draining"
        device.drain()
    except BaseException as e:
        _recover(device, pending, e)
        e.add_note(f"prefill: failed in ubatch {k + 1} of {n} while {phase} ({mode} schedule); the device was "
                   "released and drained before this error was raised")
        raise


def _recover(device, pending, err: BaseException) -> None:
    """Release the slot a launched step waits on (with harmless indices), drain, re-arm. Never masks `err`."""
    def attempt(name, fn, tries=1) -> bool:
        for _ in range(tries):
            try:
                fn()
                return True
            except BaseException as e2:   # a second Ctrl-C, or a device error: keep the first error
                log.error("prefill cleanup: %s failed: %r", name, e2)
                err.add_note(f"prefill cleanup: {name} failed: {e2!r}")
        return False

    if pending is not None:
        attempt("scrub", lambda: device.scrub(pending))
        if not attempt("release", lambda: device.release(pending), tries=2):
            err.add_note("prefill cleanup: the device could not be released; not draining (it would block)")
            return
    if attempt("drain", device.drain):
        attempt("rearm", device.rearm)
