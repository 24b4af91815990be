import pytest
import torch

from quarl.algos import drop_rows, informative_groups


def test_informative_groups_by_hand():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert informative_groups(r, 3).tolist() == [False, True, False]
    with pytest.raises(ValueError):
        informative_groups(r, 4)


def test_drop_rows_by_hand():
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = drop_rows(mask, torch.tensor([True, False]))
    assert torch.equal(out, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert torch.equal(mask, torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))  # input untouched
    with pytest.raises(ValueError, match="bool"):
        drop_rows(mask, torch.tensor([1, 0]))
