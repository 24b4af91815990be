"""The split-K planner (quarl.quant.kernels.splitk), as the kernels use it, on CPU."""

from quarl.quant.kernels import splitk
from quarl.quant.kernels.cuda_w4 import _blocked_split
from quarl.quant.kernels.w8a8 import tma_split


def _frag(n, groups, nw, sms, bps):
    """The fragment kernel's rule: (split, groups per split)."""
    plan = splitk.fill(-(-n // 64), groups, bps * sms, splitk.cdiv(groups, nw))
    return plan.split, plan.per


def test_split_keeps_a_group_per_warp():
    # gate/up of a 7B model on 132 SMs: 296 slabs fill the GPU without a split
    assert _frag(18944, 28, 4, 132, 2.0) == (1, 28)
    split, gpb = _frag(3584, 148, 4, 132, 4.0)  # down_proj: split K
    assert split > 1 and gpb * split >= 148 and gpb * (split - 1) < 148
    assert _frag(512, 2, 4, 132, 4.0) == (1, 2)  # never more splits than groups / warps
    # the tile kernel: 4 slabs per block, one group per block at least
    assert _blocked_split(148, 28, 132, 1.0, False, False)[1:3] == (1, 28)  # 148 column blocks fill the GPU
    # 18 column blocks: ceil(264 / 18) = 15 splits, rounded to whole groups: 2 each, 14 splits
    assert _blocked_split(18, 28, 132, 2.0, False, False)[1:3] == (14, 2)


def test_tail_splits_only_the_last_wave():
    # gate_up at M = 64, 3 warpgroups (198 column blocks), one block per SM: 132 whole, the
    # other 66 split in 2 (14 groups each) -> 264 blocks, the last wave full
    assert splitk.tail(198, 28, 132)[:3] == (132, 2, 14)
    # 296 column blocks on 264 slots: 32 left, split 8 ways (4 groups each, 7 splits of 4)
    assert splitk.tail(296, 28, 264)[:3] == (264, 7, 4)
    # fewer column blocks than slots: all of them split (the uniform split)
    assert splitk.tail(28, 28, 264)[:3] == (0, 7, 4)
    # full waves only, or a tail that cannot be split in 2: no split
    assert splitk.tail(264, 28, 132)[:3] == (264, 1, 28)
    assert splitk.tail(230, 28, 132)[:3] == (230, 1, 28)
    assert splitk.tail(140, 3, 132)[:3] == (140, 1, 3)  # 3 groups: >= 2 per split impossible
    for cols, groups, slots in ((198, 28, 132), (296, 28, 264), (28, 28, 264), (77, 148, 132), (600, 9, 528)):
        plan = splitk.tail(cols, groups, slots)
        assert plan.whole % slots == 0 or plan.whole == cols
        assert (plan.split - 1) * plan.per < groups <= plan.split * plan.per and (plan.split == 1 or plan.per >= 2)
        assert plan.programs(cols) <= -(-cols // slots) * slots  # never an extra wave


def test_tma_rule_is_the_same_tail_split():
    # 7B qkv at M = 1024: 288 tiles of 128 x 128 on 132 slots: 264 whole, 24 split in 5
    assert tma_split(288, 28, 132, -1) == splitk.tail(288, 28, 132)
    assert tma_split(288, 28, 132, -1)[:2] == (264, 5)
    assert tma_split(10, 28, 132, 2)[:3] == (0, 2, 14)
    assert tma_split(10, 28, 132, 1)[:3] == (10, 1, 28)


def test_blocked_split_clusters_only_fully_split_grids_of_at_most_8():
    # q/o at M = 64 (56 column blocks, 28 groups, 2 x 132 slots): 4 splits of 7, one cluster each
    assert _blocked_split(56, 28, 132, 2.0, True, True) == (0, 4, 7, 4)
    assert _blocked_split(56, 28, 132, 2.0, True, False) == (0, 4, 7, 0)
    # down at M = 64 (28 column blocks, 148 groups): 9 splits asked, capped at 8 (19 groups)
    assert _blocked_split(28, 148, 132, 2.0, True, False) == (0, 9, 17, 0)
    assert _blocked_split(28, 148, 132, 2.0, True, True) == (0, 8, 19, 8)
    # gate_up's last-wave split (whole column blocks too): global partials, no cluster
    assert _blocked_split(198, 28, 132, 1.0, True, True) == (132, 2, 14, 0)
    # no split at all: no cluster
    assert _blocked_split(592, 28, 132, 1.0, False, True) == (592, 1, 28, 0)
    for groups in range(2, 200, 7):
        for asked in range(2, 20):
            plan = splitk.clustered(splitk.even(5, groups, asked), 5, groups)
            assert plan.split <= min(asked, splitk.MAX_CLUSTER)
            assert (plan.split - 1) * plan.per < groups <= plan.split * plan.per


def test_pointer_rule_splits_only_below_one_wave():
    assert splitk.pointer_split(200, 28, 132, 0)[:3] == (200, 1, 28)
    plan = splitk.pointer_split(10, 28, 132, 0)  # ceil(264 / 10) = 27, capped at 14 (>= 2 blocks each)
    assert plan[1:3] == (14, 2)
    assert splitk.pointer_split(200, 28, 132, 3)[1:3] == (3, 10)
