"""The L2 prefetch's split of a byte range over the lanes of its programs (runtime/l2_prefetch.py): every byte
asked for exactly once, in 16-byte-aligned pieces whose sizes are multiples of 16, as the kernels' prefetching
programs compute their pieces. The GPU side (same results with and without, the decoder asks for it) is in
tests/test_fast_model.py."""

import pytest
import torch

from quantkit.runtime import l2_prefetch


def _pieces(nbytes, programs, lanes):
    """(start, size) of every lane's prefetch, as prefetch_l2 computes them, skipping empty ones."""
    piece = l2_prefetch.piece_bytes(nbytes, programs, lanes)
    out = []
    for lane in range(programs * lanes):
        start = lane * piece
        size = min(max(nbytes - start, 0), piece)
        if size > 0:
            out.append((start, size))
    return out


@pytest.mark.parametrize("nbytes", [16, 4992, 2**20, 7 * 2**20 + 48, 262_144_000])
@pytest.mark.parametrize("programs,lanes", [(32, 64), (33, 128), (36, 64), (32, 256)])
def test_pieces_cover_the_range_once_in_aligned_multiples_of_16(nbytes, programs, lanes):
    pieces = _pieces(nbytes, programs, lanes)
    assert pieces[0][0] == 0 and sum(size for _, size in pieces) == nbytes
    assert all(a + sa == b for (a, sa), (b, _) in zip(pieces, pieces[1:]))
    assert all(start % 16 == 0 and size % 16 == 0 for start, size in pieces)


def test_no_prefetch_off_cuda_or_when_off():
    cpu = torch.zeros(4096, dtype=torch.uint8)
    assert l2_prefetch.plan(cpu, 4096, 64) is None
    assert l2_prefetch.plan(None, 4096, 64) is None
    with l2_prefetch.disabled():
        assert not l2_prefetch.enabled()
    assert l2_prefetch.enabled() == (l2_prefetch.os.environ.get(l2_prefetch.ENV, "1") != "0")
    assert l2_prefetch.extra_rows(None, 18) == 0
