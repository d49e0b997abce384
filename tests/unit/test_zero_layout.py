"""The flat partitions of ZeroRedundancyOptimizer (hvdlite/torch/zero/layout.py), every
rank's view computed here: each element has exactly one owner, shards differ by one
element at most, chunks follow one another and split evenly (to one element) into
consecutive segments, a piece lies in its rank's segment of one chunk, a chunk's
parameters tile it, and a rank's parts, chunk after chunk, are its shard in order."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hvdlite.torch.zero.layout import lay_out  # noqa: E402

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
        shares = [s.shard_size for s in spaces]
        assert sum(shares) == total and max(shares) - min(shares) <= 1
        owned = {p: [] for p in spaces[0].positions}
        for rank, space in enumerate(spaces):
            walked = 0
            for piece in space.pieces:
                owned[piece.position].append((piece.start, piece.stop))
                chunk = space.chunks[piece.chunk]      # in this rank's segment of one chunk
                first, last = chunk.segments[rank]
                at = space.offset_of[piece.position] + piece.start
                assert first <= at and at + piece.stop - piece.start <= last
                assert piece.offset == chunk.mine[0] + at - first
                assert piece.offset == walked          # the shard, in order
                walked += piece.stop - piece.start
            assert walked == space.shard_size
        for position, runs in owned.items():
            flat = [e for start, stop in sorted(runs) for e in range(start, stop)]
            assert flat == list(range(params[position].numel()))
        for rank, space in enumerate(spaces):
            begins = [c.mine[0] for c in space.chunks]
            assert begins == [sum(c.counts[rank] for c in space.chunks[:k])
                              for k in range(len(space.chunks))]
        ends = 0
        for chunk in spaces[0].chunks:
            assert max(chunk.counts) - min(chunk.counts) <= 1
            assert chunk.segments[0][0] == ends          # one after another, tiling
            for (start, stop), count in zip(chunk.segments, chunk.counts):
                assert stop - start == count and start == ends
                ends = stop
            # The chunk's parameters' overlaps tile it, in order, each as long on both sides,
            # each in the segment it names.
            covered, tops = 0, [sum(chunk.counts[:r + 1]) for r in range(size)]
            for position in chunk.positions:
                runs = spaces[0].overlap(chunk, position)
                assert runs
                for rank, in_chunk, in_param in runs:
                    assert in_chunk.start == covered and in_chunk.stop <= tops[rank]
                    assert in_chunk.stop - in_chunk.start == in_param.stop - in_param.start > 0
                    covered = in_chunk.stop
            assert covered == sum(chunk.counts)
        assert ends == total
