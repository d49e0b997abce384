"""The flat partitions of ZeroRedundancyOptimizer (hvdlite/torch/zero_layout.py), every
rank's view computed here: each element has exactly one owner, shares differ by one
element at most, a piece lies in one chunk, a chunk's parameters tile it, each chunk's
counts are the parts of its owners, and a rank's parts, chunk after chunk, are its range
in order."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hvdlite.torch.zero_layout import lay_out  # noqa: E402

SIZES = [[0], [1], [7], [0, 1, 2, 3, 5, 7, 11, 13], [31, 33, 63, 65, 127, 129], [1021, 0, 1]]


@pytest.mark.parametrize("numels", SIZES, ids=str)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("chunk_bytes", [4, 12, 40, 1 << 20])
def test_every_element_has_one_owner_and_chunks_carry_each_ranks_part(
        numels: list[int], size: int, chunk_bytes: int) -> None:
    params = [torch.zeros(n, dtype=torch.float32 if i % 3 else torch.float64)
              for i, n in enumerate(numels)]
    views = [lay_out(params, rank, size, chunk_bytes) for rank in range(size)]
    for index in range(len(views[0])):
        spaces = [rank_spaces[index] for rank_spaces in views]
        total = spaces[0].total
        assert total == sum(params[p].numel() for p in spaces[0].positions)
        shares = [s.hi - s.lo for s in spaces]
        assert sum(shares) == total and max(shares) - min(shares) <= 1
        assert [s.lo for s in spaces] == [0] + [s.hi for s in spaces[:-1]]
        owned = {p: [] for p in spaces[0].positions}
        for space in spaces:
            for piece in space.pieces:
                owned[piece.position].append((piece.start, piece.stop))
                assert piece.offset == space.offset_of[piece.position] + piece.start - space.lo
                chunk = space.chunks[piece.chunk]      # within one chunk, in this rank's part
                assert chunk.mine[0] <= piece.offset
                assert piece.offset + piece.stop - piece.start <= chunk.mine[1]
        for position, runs in owned.items():
            flat = [e for start, stop in sorted(runs) for e in range(start, stop)]
            assert flat == list(range(params[position].numel()))
        for rank, space in enumerate(spaces):
            parts = [(c.mine, c.counts[rank]) for c in space.chunks]
            assert sum(count for _, count in parts) == space.hi - space.lo
            walked = 0
            for (begin, end), count in parts:
                if count:
                    assert (begin, end) == (walked, walked + count)
                    walked = end
        for chunk in spaces[0].chunks:
            assert sum(chunk.counts) == chunk.stop - chunk.start
            # The chunk's parameters' overlaps tile it, in order, each as long on both sides.
            covered = 0
            for position in chunk.positions:
                in_chunk, in_param = spaces[0].overlap(chunk, position)
                assert in_chunk.start == covered
                assert in_chunk.stop - in_chunk.start == in_param.stop - in_param.start > 0
                covered = in_chunk.stop
            assert covered == chunk.stop - chunk.start
