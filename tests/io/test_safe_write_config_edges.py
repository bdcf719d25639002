"""Host branches of safe_write.py and config.py the rest of the suite leaves unexecuted (issue 17 coverage)."""
import os
import stat

import pytest

from gds_gather.io import safe_write
from gds_gather.config import Config
from gds_gather.errors import OutputPathError


def test_file_kind_of_a_mode_no_kind_matches():
    assert safe_write.file_kind(stat.S_IFREG | 0o644) == "not a regular file"
    assert safe_write.file_kind(stat.S_IFDIR) == "a directory"


@pytest.mark.parametrize("name", ["..", "/"])
def test_check_output_refuses_a_path_without_a_file_name(name):
    with pytest.raises(OutputPathError, match="not a file name"):
        safe_write.check_output(name)


def test_check_output_reports_an_lstat_error_other_than_missing(tmp_path):
    (tmp_path / "plain").write_bytes(b"x")
    target = tmp_path / "plain" / "out.gguf"          # a path through a regular file: ENOTDIR
    with pytest.raises(OutputPathError) as ei:
        safe_write.check_output(target)
    assert str(ei.value) == f"{target}: {os.strerror(20)}"   # ENOTDIR's message, naming the user's path
    assert (tmp_path / "plain").read_bytes() == b"x"


def test_atomic_output_names_the_directory_it_cannot_create_a_file_in():
    target = "/proc/gds-gather-cover-out.bin"         # /proc exists but takes no new files, even for root
    with pytest.raises(OutputPathError, match=r"^/proc/gds-gather-cover-out\.bin: cannot create a file in /proc \("):
        with safe_write.atomic_output(target):
            pytest.fail("the body must not run")
    assert not os.path.exists(target)


def _mode_of_written(tmp_path, name):
    out = tmp_path / name
    with safe_write.atomic_output(out) as tmp:
        tmp.write_bytes(b"data")
    assert out.read_bytes() == b"data"
    return stat.S_IMODE(os.stat(out).st_mode)


def test_umask_falls_back_to_022_when_proc_status_cannot_be_read(tmp_path, monkeypatch):
    old = os.umask(0o077)
    try:
        assert _mode_of_written(tmp_path, "read.bin") == 0o600          # the real umask, read from /proc
        def no_proc(*a, **k):
            raise OSError(13, "Permission denied")
        monkeypatch.setattr(safe_write, "open", no_proc, raising=False)
        assert _mode_of_written(tmp_path, "fallback.bin") == 0o644      # 0666 & ~022, not the process's 077
    finally:
        os.umask(old)


def test_config_refuses_an_unknown_engine():
    with pytest.raises(ValueError, match=r"^GDS_GATHER_ENGINE \(engine\) must be auto, uring or threads, got 'aio'$"):
        Config(engine="aio")


@pytest.mark.parametrize("bad", [-1.0, True, "3", float("nan")])
def test_config_refuses_a_bad_max_waste(bad):
    with pytest.raises(ValueError, match=r"^GDS_GATHER_MAX_WASTE \(max_waste\) must be a number >= 0, got "):
        Config(max_waste=bad)


def test_from_env_parses_float_fields_and_names_a_bad_one():
    assert Config.from_env({"GDS_GATHER_MAX_WASTE": "2.5"}).max_waste == 2.5
    with pytest.raises(ValueError, match=r"^GDS_GATHER_MAX_WASTE='lots' is not a number$"):
        Config.from_env({"GDS_GATHER_MAX_WASTE": "lots"})
