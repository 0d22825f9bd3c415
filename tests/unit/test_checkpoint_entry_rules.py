"""The rules that decide, for every rank alike, whether a load takes a state entry from the checkpoint or regenerates
it (elastic/checkpoint/entry_rules.py), as a table: no I/O, no processes."""

from __future__ import annotations

import pytest

from elastic.checkpoint.entry_rules import (
    Load,
    RankView,
    Refuse,
    Regenerate,
    SavedEntry,
    decide,
    rank_view,
    summarize_keys,
    world_sizes,
)

pytestmark = pytest.mark.timeout(30)

TORCHTITAN_AT_2 = SavedEntry(("dl.dp_rank_0", "dl.dp_rank_1", "dl.world_size"), (("dl.world_size", 2),))
PER_RANK_AT_2 = SavedEntry(("dl.dp_rank_0", "dl.dp_rank_1"), ())
GLOBAL = SavedEntry(("dl.epoch", "dl.samples_consumed", "dl.seed"), ())
MODEL = SavedEntry(("model.w", "model.b"), ())


def torchtitan_loader(rank: int, world: int, regenerable: bool = False) -> RankView:
    """torchtitan's dataloader on ``rank``: its own position key and the degree it runs at."""
    keys = {f"dl.dp_rank_{rank}", "dl.world_size"}
    saved = TORCHTITAN_AT_2.keys
    return rank_view(keys, saved, "ParallelAwareDataloader", regenerable, (("dl.world_size", world),))


def per_rank_loader(rank: int, saved: SavedEntry, regenerable: bool = True) -> RankView:
    return rank_view({f"dl.dp_rank_{rank}"}, saved.keys, "PerRank", regenerable, ())


def global_loader(saved: SavedEntry, regenerable: bool = True) -> RankView:
    return rank_view({"dl.epoch", "dl.samples_consumed", "dl.seed"}, saved.keys, "Global", regenerable, ())


def model(saved: SavedEntry, keys: tuple[str, ...] = ("model.w", "model.b")) -> RankView:
    return rank_view(set(keys), saved.keys, "ModelState", False, ())


CASES = [
    # (what, saved, views, saved world size, world size, expected decision, text in its reason or message)
    (
        "torchtitan's loader at its own degree loads each rank exactly",
        TORCHTITAN_AT_2,
        list(torchtitan_loader(rank, 2) for rank in range(2)),
        2,
        2,
        Load,
        None,
    ),
    (
        "torchtitan's loader grown 2 -> 4 is regenerated on every rank, the ranks that find their key too",
        TORCHTITAN_AT_2,
        list(torchtitan_loader(rank, 4, regenerable=True) for rank in range(4)),
        2,
        4,
        Regenerate,
        "saved at world_size 2, now 4",
    ),
    (
        "torchtitan's loader shrunk 2 -> 1: rank 0 finds its key, and is regenerated all the same",
        TORCHTITAN_AT_2,
        [torchtitan_loader(0, 1, regenerable=True)],
        2,
        1,
        Regenerate,
        "saved at world_size 2, now 1",
    ),
    (
        "the degree the entry recorded counts, not the number of ranks (data parallel 2 of 4 ranks)",
        TORCHTITAN_AT_2,
        list(torchtitan_loader(rank % 2, 2) for rank in range(4)),
        4,
        4,
        Load,
        None,
    ),
    (
        "torchtitan's own loader grown 2 -> 4 cannot regenerate: refused for every rank, named",
        TORCHTITAN_AT_2,
        list(torchtitan_loader(rank, 4) for rank in range(4)),
        2,
        4,
        Refuse,
        "give that object (ParallelAwareDataloader) a regenerate_state(step) method (not on ranks 0, 1, 2, 3)",
    ),
    (
        "per-rank keys and no world size, grown 2 -> 4 (the commit record's size): regenerated on every rank",
        PER_RANK_AT_2,
        list(per_rank_loader(rank, PER_RANK_AT_2) for rank in range(4)),
        2,
        4,
        Regenerate,
        "saved by 2 ranks, now 4",
    ),
    (
        "per-rank keys shrunk 2 -> 1: the one rank leaves dp_rank_1 unread, so it is per rank: regenerated",
        PER_RANK_AT_2,
        [per_rank_loader(0, PER_RANK_AT_2)],
        2,
        1,
        Regenerate,
        "dl.dp_rank_{0..1}), saved by 2 ranks, now 1",
    ),
    (
        "per-rank keys at an unknown saved size count as resized",
        PER_RANK_AT_2,
        list(per_rank_loader(rank, PER_RANK_AT_2) for rank in range(2)),
        None,
        2,
        Regenerate,
        "saved by an unknown number of ranks, now 2",
    ),
    (
        "per-rank keys at the same size load each rank exactly",
        PER_RANK_AT_2,
        list(per_rank_loader(rank, PER_RANK_AT_2) for rank in range(2)),
        2,
        2,
        Load,
        None,
    ),
    (
        "a global entry loads at any world size",
        GLOBAL,
        list(global_loader(GLOBAL) for _ in range(16)),
        8,
        16,
        Load,
        None,
    ),
    (
        "a global loader over torchtitan's per-rank keys, same size: a foreign layout, regenerated",
        TORCHTITAN_AT_2,
        list(global_loader(TORCHTITAN_AT_2) for _ in range(2)),
        2,
        2,
        Regenerate,
        "holds dl.dp_rank_{0..1}, dl.world_size for state entry 'dl', not its keys",
    ),
    (
        "a global loader over per-rank keys of another size: regenerated as resized per-rank state",
        PER_RANK_AT_2,
        list(global_loader(PER_RANK_AT_2) for _ in range(3)),
        2,
        3,
        Regenerate,
        "saved by 2 ranks, now 3",
    ),
    (
        "a foreign layout that cannot regenerate is refused, naming its keys and the checkpoint's",
        GLOBAL,
        [rank_view({"dl.position"}, GLOBAL.keys, "Loader", False, ())],
        1,
        1,
        Refuse,
        "has none of the keys of state entry 'dl' (dl.position) and holds dl.epoch, dl.samples_consumed, dl.seed",
    ),
    (
        "the model (sharded, same keys on every rank) loads resharded",
        MODEL,
        list(model(MODEL) for _ in range(4)),
        2,
        4,
        Load,
        None,
    ),
    (
        "a model with a key the checkpoint lacks is refused, naming the rank and the key",
        MODEL,
        list(model(MODEL, ("model.w", "model.b", "model.extra")) for _ in range(2)),
        2,
        2,
        Refuse,
        "lacks 1 of the 3 keys of state entry 'model' on rank 0: model.extra; the model or optimizer differs",
    ),
    (
        "an entry the checkpoint holds nothing for, and that can regenerate, is regenerated",
        SavedEntry((), ()),
        [global_loader(SavedEntry((), ()))],
        1,
        1,
        Regenerate,
        "holds nothing for state entry 'dl', not its keys",
    ),
]


@pytest.mark.parametrize(
    "saved, views, saved_world_size, world_size, expected, text",
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_rules(saved, views, saved_world_size, world_size, expected, text) -> None:
    decision = decide("dl" if saved is not MODEL else "model", saved, views, saved_world_size, world_size)
    assert type(decision) is expected
    if isinstance(decision, Regenerate):
        assert text in decision.reason
    elif isinstance(decision, Refuse):
        assert text in decision.message
    else:
        assert text is None


def test_every_rank_gets_the_same_decision_whatever_keys_it_holds() -> None:
    """The seed's failure: at 4 ranks, ranks 0-1 find dp_rank_0/1 and ranks 2-3 do not. One decision for all."""
    views = [torchtitan_loader(rank, 4, regenerable=True) for rank in range(4)]
    assert [view.missing for view in views] == [0, 0, 1, 1]
    decisions = {decide("dl", TORCHTITAN_AT_2, views, 2, 4) for _ in range(4)}
    assert len(decisions) == 1 and isinstance(decisions.pop(), Regenerate)


def test_views_carry_few_key_names_whatever_the_entry_holds() -> None:
    view = rank_view({f"k{index}" for index in range(1000)}, (), "Big", False, ())
    assert (view.wanted, view.missing, len(view.missing_named)) == (1000, 1000, 8)
    refused = decide("k", SavedEntry((), ()), [view], 1, 1)
    assert isinstance(refused, Refuse) and "and 992 more" in refused.message


def test_world_sizes_are_integers_under_a_world_size_name() -> None:
    flat = {"dl.world_size": 8, "dl.dp_degree": 4, "dl.dp_rank_0": b"x", "dl.flag.world_size": True, "x.world": 2}
    assert world_sizes(flat) == (("dl.dp_degree", 4), ("dl.world_size", 8))


def test_summarize_keys_collapses_numbered_keys() -> None:
    keys = [f"dataloader.dp_rank_{rank}" for rank in range(8)] + ["dataloader.world_size", "a.x_1", "a.x_3"]
    assert summarize_keys(keys) == "a.x_{1,3}, dataloader.dp_rank_{0..7}, dataloader.world_size"
    assert summarize_keys([f"k{index}.v" for index in range(3)] + ["z1", "z2"], limit=1) == "k{0..2}.v and 1 more"
