"""The rank files' write (chakra/writer.py's _write_file: os.open and one writev): the parts back to back, as a
file object writes them; on a full disk, the write that stopped short goes on and raises ENOSPC, never leaving
a file cut short unnoticed."""
import errno
import os
import subprocess

import numpy as np
import pytest

from syntorch.chakra.writer import _write_file


def test_the_parts_are_written_back_to_back(tmp_path):
    head, body = b"\x05head!", np.arange(300_000, dtype=np.int64).astype(np.uint8)
    path = tmp_path / "r.0.et"
    path.write_bytes(b"an earlier, longer file" * 100_000)  # replaced whole, as open(path, "wb") does
    assert _write_file(str(path), [head, body.data]) == len(head) + body.nbytes
    assert path.read_bytes() == head + body.tobytes()


def test_a_full_disk_raises_instead_of_a_short_file(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(OSError) as raised:
            _write_file(str(small / "r.0.et"), [b"head", bytes(200_000)])
        assert raised.value.errno == errno.ENOSPC
        assert os.path.getsize(small / "r.0.et") < 200_004  # what fitted: the write did stop short
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)
