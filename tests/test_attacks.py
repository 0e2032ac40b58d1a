"""The poisoned contributions `bench attack` sends: each is what its paper describes."""

import pytest
import torch

from atomtrain.errors import AtomError
from atomtrain.peer.attack import (
    ALIE_Z,
    ATTACKS,
    IPM_EPSILON,
    LabelFlippedLoader,
    check_attack,
    poison,
)


def honest() -> torch.Tensor:
    return torch.randn(1000, generator=torch.Generator().manual_seed(0))


def test_model_poisoning_attacks_transform_the_honest_update():
    d = honest()
    assert torch.equal(poison("sign_flip", d), -d)
    assert torch.allclose(poison("ipm", d), -IPM_EPSILON * d)
    alie = poison("alie", d)
    # every coordinate moved down by z of its spread: a little, one way, never more than 2|d|
    assert torch.allclose(d - alie, ALIE_Z * d.abs())
    assert (alie <= d).all() and (alie.abs() <= 2 * d.abs() + 1e-7).all()
    assert float(alie.sum()) < float(d.sum())  # a net pull in one direction
    assert torch.equal(poison("label_flip", d), d)  # poisons the data, not the update
    assert not torch.isfinite(poison("nan", d)).any()


class Source:
    def __init__(self) -> None:
        self.calls = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, 0]])

    def state_dict(self) -> dict:
        return {"calls": self.calls}


def test_label_flip_trains_on_flipped_targets_and_keeps_the_loaders_state():
    loader = LabelFlippedLoader(Source(), vocab_size=10)
    x, y = loader.next_batch()
    assert x.tolist() == [[1, 2, 3]] and y.tolist() == [[7, 6, 9]]
    assert loader.state_dict() == {"calls": 1}  # checkpoints see the real loader


def test_every_attack_is_accepted_and_others_named():
    for kind in ATTACKS:
        check_attack(kind)
    with pytest.raises(AtomError, match="sign_flip"):
        check_attack("flip")
