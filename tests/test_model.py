import math

import pytest
import torch

from atomtrain.errors import AtomError
from atomtrain.models import GPT, PRESETS, GPTConfig, generate


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny", **kw))


def test_forward_shapes_and_initial_loss_near_uniform():
    model = tiny()
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx, torch.randint(0, 256, (3, 16)))
    assert logits.shape == (3, 16, 256)
    assert abs(loss.item() - math.log(256)) < 0.3


def test_blocks_live_in_a_module_list_and_embeddings_are_tied():
    model = tiny()
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert model.lm_head.weight is model.wte.weight


def test_attention_is_causal():
    model = tiny().eval()
    a = torch.randint(0, 256, (1, 20))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    la, _ = model(a)
    lb, _ = model(b)
    torch.testing.assert_close(la[:, :10], lb[:, :10])
    assert not torch.allclose(la[:, 10:], lb[:, 10:])


@pytest.mark.parametrize(
    "name, billions",
    [
        ("gpt3-125m", 0.125),
        ("gpt3-350m", 0.35),
        ("gpt3-1.3b", 1.3),
        ("gpt3-13b", 13.0),
        ("gpt3-175b", 175.0),
    ],
)
def test_gpt3_presets_have_their_published_size_on_meta(name, billions):
    cfg = GPTConfig.from_name(name)
    assert cfg.block_size == 2048 and cfg.vocab_size == 50304
    with torch.device("meta"):
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert model.num_parameters() / 1e9 == pytest.approx(billions, rel=0.08)
    assert cfg.num_parameters() == model.num_parameters()  # what `atomtrain plan` counts


@pytest.mark.parametrize("bias", [True, False])
def test_a_shape_counts_the_parameters_of_the_model_it_builds(bias: bool):
    for name in ("tiny", "small", "gpt3-125m"):
        cfg = GPTConfig.from_name(name, bias=bias)
        with torch.device("meta"):
            assert GPT(cfg).num_parameters() == cfg.num_parameters()


def test_every_preset_builds_on_meta():
    for name in PRESETS:
        with torch.device("meta"):
            GPT(GPTConfig.from_name(name))


def test_unknown_preset_and_bad_shape_are_clear_errors():
    with pytest.raises(AtomError, match="unknown model preset 'gpt5'"):
        GPTConfig.from_name("gpt5")
    with pytest.raises(AtomError, match="n_embd"):
        GPTConfig(n_embd=30, n_head=4)


def test_greedy_generation_is_deterministic_and_extends_the_prompt():
    model = tiny().eval()
    idx = torch.tensor([[1, 2, 3]])
    a = generate(model, idx, 10, temperature=0)
    b = generate(model, idx, 10, temperature=0)
    assert a.shape == (1, 13) and torch.equal(a, b) and torch.equal(a[:, :3], idx)
