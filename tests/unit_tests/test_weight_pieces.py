"""Weight sync's pieces (twinstep.wire.weight_pieces): bounded messages, bit-exact reassembly, hostile input refused."""

from __future__ import annotations

import numpy as np
import pytest

from twinstep.v1 import twinstep_pb2 as pb
from twinstep.wire.weight_pieces import Assembler, Expected, PieceError, pieces


@pytest.mark.parametrize("compress", [False, True])
def test_a_tensor_larger_than_a_piece_comes_back_bit_for_bit(compress):
    bits = np.random.default_rng(0).integers(0, 1 << 16, size=700_000, dtype=np.uint16)  # bfloat16 patterns
    bits[::2] = 0  # half zeros: zstd has something to take
    sent = list(pieces(3, bits, compress=compress, piece_bytes=1 << 18))
    assert len(sent) == 6 and all(p.raw_nbytes <= 1 << 18 for p in sent)
    assert {p.codec for p in sent} == ({pb.ZSTD} if compress else {pb.RAW})
    assembler = Assembler({3: Expected("w", "bfloat16", bits.size)})
    for piece in sent:
        assembler.add(pb.WeightPiece.FromString(piece.SerializeToString()))
    got = assembler.finish()[3]
    assert got.dtype == np.uint16 and np.array_equal(got, bits)


def piece(**fields) -> pb.WeightPiece:
    values = np.arange(4, dtype=np.float32)
    base = dict(parameter=0, offset=0, numel=4, codec=pb.RAW, raw_nbytes=16, data=values.tobytes())
    return pb.WeightPiece(**{**base, **fields})


@pytest.mark.parametrize(("bad", "message"), [
    (piece(parameter=9), "parameter 9, which was not announced"),
    (piece(offset=2), "starts at element 2, expected 0"),
    (piece(numel=8, raw_nbytes=32, data=bytes(32)), "does not fit its 4"),
    (piece(raw_nbytes=12), "announces 12 bytes"),
    (piece(codec=pb.ZSTD, data=b"not zstd"), "corrupt zstd"),
    (piece(codec=pb.QUANT_ZSTD), "not lossless"),
])
def test_a_bad_piece_is_refused_with_what_is_wrong(bad, message):
    with pytest.raises(PieceError, match=message):
        Assembler({0: Expected("w", "float32", 4)}).add(bad)


def test_pieces_that_end_early_name_what_is_missing():
    assembler = Assembler({0: Expected("w", "float32", 4), 1: Expected("b", "float32", 2)})
    assembler.add(piece(numel=2, raw_nbytes=8, data=bytes(8)))
    with pytest.raises(PieceError, match=r"w: 2 of 4 elements; b: 0 of 2 elements"):
        assembler.finish()
