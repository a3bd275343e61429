"""Training anchors: uniform, and `anchors: rejection` (DecodeStarts) drawn toward where a greedy decode starts."""
import pytest
import torch

from train.anchors import DecodeStarts, accepted_in_chunks, every_anchor, sample_anchors, valid_anchors, walked_accepted
from train.data import rows_for_step

T, DRAFTS, HARD = 64, 4, 5  # in these tests the drafter misses exactly the tokens at positions 0 mod HARD


def accepted_at(anchors: torch.Tensor) -> torch.Tensor:
    """Greedy accepted drafts of a block at each anchor for a drafter that gets every token right except those at
    positions 0 mod HARD: the drafts run up to the next such position (at most DRAFTS)."""
    nxt = (anchors // HARD + 1) * HARD  # the next hard position after a
    return (nxt - anchors - 1).clamp(max=DRAFTS)


def decode_walk(start: int) -> list[int]:
    """The anchors a greedy decode visits from `start`: a, then a + accepted + 1, ..."""
    out, a = [], start
    while a <= T - 1 - DRAFTS:
        out.append(a)
        a += int(accepted_at(torch.tensor(a))) + 1
    return out


def test_uniform_anchors_are_distinct_valid_positions():
    mask = torch.zeros(3, T, dtype=torch.bool)
    mask[:, 10:] = True
    a = sample_anchors(mask, 8, DRAFTS, torch.Generator().manual_seed(0))
    ok = valid_anchors(mask, DRAFTS)
    assert a.shape == (3, 8) and bool(ok.gather(1, a).all())
    assert all(len(set(r)) == 8 for r in a.tolist()) and a.min() >= 9 and a.max() <= T - 1 - DRAFTS


def test_walked_accepted_visits_the_blocks_a_greedy_decode_starts():
    """every_anchor lists each row's valid anchors in order (a shorter row padded with its first); walked_accepted
    keeps the accepted counts of the anchors a greedy decode visits, from one past the row's first anchor (the
    prompt's last token): the same walk as decode_walk, whatever the row's prompt length."""
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[0, 11:] = True  # prompt of 11 tokens: first anchor 10 (its first label 11), the walk starts at 11
    mask[1, 24:] = True
    every = every_anchor(mask, DRAFTS)
    ok = valid_anchors(mask, DRAFTS)
    assert every[0].tolist() == ok[0].nonzero().flatten().tolist()
    n1 = int(ok[1].sum())
    assert every[1, :n1].tolist() == ok[1].nonzero().flatten().tolist() and set(every[1, n1:].tolist()) == {23}
    walked = walked_accepted(every, accepted_at(every))
    want = [int(accepted_at(torch.tensor(a))) for s in (11, 24) for a in decode_walk(s)]
    assert walked == want


def test_accepted_in_chunks_equals_one_call_with_bounded_calls():
    """The holdout's every-anchor pass: prepare once per chunk of rows, then calls of at most rows x anchors blocks,
    each block's count where one call over all of them puts it (rows and anchor columns in order)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 100, (7, 40), generator=g)
    anchors = torch.sort(torch.randint(1, 30, (7, 23), generator=g), 1).values
    prepared, sizes = [], []

    def prepare(x):
        prepared.append(len(x))
        return x * 3

    def accepted_of(x3, a):  # a function of each block's row and anchor alone, as the drafter's blocks are
        sizes.append(a.numel())
        return (x3.gather(1, a) + a) % 8

    got = accepted_in_chunks(prepare, accepted_of, rows, anchors, 3, 5)
    assert torch.equal(got, (rows.gather(1, anchors) * 3 + anchors) % 8)
    assert prepared == [3, 3, 1] and max(sizes) == 15 and sum(sizes) == anchors.numel()


def test_rejection_anchors_follow_the_decode_walk():
    """After a row is trained once, share x num of its anchors are where that step's blocks ended (a + accepted + 1):
    for this drafter, only hard positions, which is where a greedy decode starts its blocks after the first. The
    other anchors are uniform, and a row not yet trained gets uniform anchors only."""
    n_rows, num = 4, 8
    mask = torch.ones(n_rows, T, dtype=torch.bool)
    starts = DecodeStarts(n_rows, T, share=0.5, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([0, 1])
    first = starts.sample(rows, mask[rows], num, DRAFTS, g)
    starts.update(rows, first, accepted_at(first))
    ends = [set(r) for r in (first + accepted_at(first) + 1).tolist()]
    decode_starts = {p for s in range(1, HARD + 1) for p in decode_walk(s)[1:]}  # every start after the first
    assert decode_starts == set(range(HARD, T - DRAFTS, HARD))
    assert all(e <= decode_starts | {T - 1} for e in ends)  # T - 1: a block that ran past the row's end
    again = starts.sample(torch.tensor([0, 1, 2]), mask[:3], num, DRAFTS, g)
    for row, row_ends in zip(again.tolist()[:2], ends):
        assert len(set(row)) == num and all(1 <= p <= T - 1 - DRAFTS for p in row)
        assert len(row_ends & decode_starts) >= 4 and len(set(row) & row_ends) >= 4, (row, row_ends)
    assert sum(p % HARD == 0 for p in again[2].tolist()) < num // 2  # the untrained row: no pull toward them


def test_rejection_share_one_draws_every_recorded_start_first():
    mask = torch.ones(1, T, dtype=torch.bool)
    starts = DecodeStarts(1, T, share=1.0, device=torch.device("cpu"))
    starts.update(torch.tensor([0]), torch.tensor([[3, 20, 40]]), torch.tensor([[1, 4, 0]]))
    assert starts.starts[0].nonzero().flatten().tolist() == [5, 25, 41]
    a = starts.sample(torch.tensor([0]), mask, 5, DRAFTS, torch.Generator().manual_seed(1))
    assert set(a[0, :3].tolist()) == {5, 25, 41} and len(set(a[0].tolist())) == 5
    starts.update(torch.tensor([0]), torch.tensor([[10]]), torch.tensor([[2]]))  # a row's starts are replaced
    assert starts.starts[0].nonzero().flatten().tolist() == [13]
    state = starts.state_dict()
    fresh = DecodeStarts(1, T, share=1.0, device=torch.device("cpu"))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.starts, starts.starts)


def test_recipe_anchor_fields_are_validated():
    from dspark.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"anchors: expected one of \['uniform', 'rejection'\]"):
        load_recipe("recipes/quickstart.yaml", ["anchors=walked"])
    with pytest.raises(RecipeError, match=r"rejection_share: expected a share in \[0, 1\]"):
        load_recipe("recipes/quickstart.yaml", ["anchors=rejection", "rejection_share=2"])
    assert load_recipe("recipes/quickstart.yaml").anchors == "uniform"


@pytest.mark.parametrize("n, batch", [(10, 4), (3, 7), (64, 8)])
def test_rows_in_passes_see_every_sequence_once_per_pass(n, batch):
    """data.order=passes: the rows of consecutive steps, concatenated, are one permutation of the n sequences after
    another (a step may straddle two passes, or span several when batch > n); passes differ from each other; the rows
    of a step depend only on (seed, step), so a resumed run draws the same; another seed another order."""
    g = torch.Generator()
    steps = 3 * n  # 3 * batch passes
    drawn = torch.cat([rows_for_step(n, s, batch, 0, "passes", g) for s in range(steps)])
    passes = drawn.view(-1, n)
    assert all(sorted(p.tolist()) == list(range(n)) for p in passes)
    assert len({tuple(p.tolist()) for p in passes}) > 1
    assert torch.equal(rows_for_step(n, 5, batch, 0, "passes", g), drawn[5 * batch:6 * batch])
    assert not torch.equal(torch.cat([rows_for_step(n, s, batch, 1, "passes", g) for s in range(steps)]), drawn)


def test_rows_with_replacement_are_the_steps_generator_draws():
    """data.order=replacement (the default): the step's generator draws the rows, as the trainer always did."""
    got = rows_for_step(100, 7, 16, 0, "replacement", torch.Generator().manual_seed(123))
    assert torch.equal(got, torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(123)))
