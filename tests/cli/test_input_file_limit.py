"""The 8 MiB limit on input files holds for files whose size the system does not know (a device, a pipe): only
the limit and a byte are read. `hetrain devices --cluster /dev/zero` grew to 2.67 GB and ended "ran out of memory"."""

import os
import threading

import pytest

from hetrain.errors import HetrainError
from hetrain.userfiles import read_text


def test_an_endless_device_is_refused_at_the_limit():
    with pytest.raises(HetrainError, match=r"cluster file '/dev/zero' is over 8 MiB; hetrain reads cluster files of "
                                           r"at most 8 MiB; fix: check that this is the right file"):
        read_text("/dev/zero", "cluster file")


@pytest.mark.parametrize("text, fits", [("nodes: []\n", True), ("x" * 65, False)])
def test_a_pipe_is_read_when_small(text, fits):
    r, w = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(w, text.encode()), os.close(w)))
    writer.start()
    try:
        if fits:
            assert read_text(f"/dev/fd/{r}", "cluster file", max_bytes=64) == text
        else:
            with pytest.raises(HetrainError, match="cluster file .* is over 6.10352e-05 MiB"):
                read_text(f"/dev/fd/{r}", "cluster file", max_bytes=64)
    finally:
        writer.join()
        os.close(r)
