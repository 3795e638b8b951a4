"""Files relibra writes (replay, loads, expert weights) get the umask's permissions, as any
file a user writes: safetensors' ``save_file`` alone makes them 0600, which other users of a
shared cluster cannot read. A file cut short says so in plain words."""

import os

import torch

from relibra_torch.replay.fileio import read_header, read_tensors, write_tensors


def test_written_files_follow_the_umask(tmp_path):
    for umask, want in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        old = os.umask(umask)
        try:
            path = tmp_path / f"r{umask:o}.safetensors"
            write_tensors(path, {"x": torch.arange(6)}, {"format": "test"})
        finally:
            os.umask(old)
        assert os.stat(path).st_mode & 0o777 == want, (oct(umask), oct(os.stat(path).st_mode))
        assert torch.equal(read_tensors(read_header(path), ["x"])["x"], torch.arange(6))
    # nothing else is left in the folder (no temporary file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r2.safetensors", "r22.safetensors", "r77.safetensors"]


def test_a_file_cut_short_says_so(tmp_path):
    """A partial copy keeps the header but loses the data: the error says the plain reason."""
    import json
    import struct

    import pytest

    header = json.dumps({"x": {"dtype": "I64", "shape": [1000], "data_offsets": [0, 8000]}}).encode()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(ValueError, match=r"the file is cut short \(a partial copy or download\?\): its data "
                                         r"holds 16 bytes, this tensor ends at byte 8,000"):
        read_header(path)
