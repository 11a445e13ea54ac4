"""Bit packing of integer codes: exact round trips at every width and the stated layout."""

import pytest
import torch

from quantkit.formats.packing import pack_rows, unpack_rows, words_per_row


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("shape", [(3, 32), (5, 37), (1, 1), (64, 576)])
def test_pack_unpack_roundtrip(bits, shape):
    gen = torch.Generator().manual_seed(bits * 100 + shape[1])
    codes = torch.randint(0, 2**bits, shape, generator=gen)
    packed = pack_rows(codes, bits)
    assert packed.dtype == torch.int32
    assert packed.shape == (shape[0], words_per_row(shape[1], bits))
    assert torch.equal(unpack_rows(packed, bits, shape[1]).long(), codes)


def test_pack_bit_order_is_lsb_first():
    # codes 1, 2 at 4 bits -> 0x21; a code of 15 in the top nibble sets the sign bit of the int32
    packed = pack_rows(torch.tensor([[1, 2, 0, 0, 0, 0, 0, 15]]), 4)
    assert packed.item() == (0x21 | (15 << 28)) - 2**32


def test_codes_straddle_words_for_3_bits():
    codes = torch.tensor([[7] * 11])  # 33 bits: the 11th code has bits 30, 31 in word 0 and bit 32 in word 1
    packed = pack_rows(codes, 3)
    assert packed.shape == (1, 2)
    assert packed[0, 0].item() == -1  # all 32 bits set
    assert packed[0, 1].item() == 0b1
