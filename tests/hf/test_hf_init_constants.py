"""sf.init.from_module follows what a transformers model's constructor sets: parameters its
`_init_weights` leaves alone but `__init__` makes as constants (zeros / ones / full), and
BertForMaskedLM's `cls.predictions.bias`, which `_init_weights` zeroes through the source
name of a tie (`decoder.bias` is tied to it): both were refused."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
I = sf.init


def _bert(device="meta"):
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32)
    with torch.device(device):
        return transformers.BertForMaskedLM(cfg)


def test_bert_masked_lm_head_bias_is_the_models_zeros():
    desc = I.from_module(_bert())
    assert desc["cls"]["predictions"]["bias"].init == I.zeros()
    torch.manual_seed(0)
    real = _bert("cpu")
    values = I.materialize(desc, seed=0)
    assert torch.equal(values["cls"]["predictions"]["bias"], real.cls.predictions.bias.detach())
    # every constant of the description is the model's own value, exactly
    _, params = sf.functional(real)
    flat_desc = torch.utils._pytree.tree_leaves(desc, is_leaf=lambda x: isinstance(x, I.Param))
    flat_real = torch.utils._pytree.tree_leaves(params)
    flat_ours = torch.utils._pytree.tree_leaves(values)
    constants = [(o, r) for d, o, r in zip(flat_desc, flat_ours, flat_real) if d.init in (I.zeros(), I.ones())]
    assert len(constants) >= 10 and all(torch.equal(o, r.detach()) for o, r in constants)


class ToyConfig(transformers.PretrainedConfig):
    model_type = "shardfn_toy_constants"

    def __init__(self, d=8, **kw):
        self.d = d
        super().__init__(**kw)


class Toy(transformers.PreTrainedModel):
    config_class = ToyConfig

    def __init__(self, config, random_gate=False):
        super().__init__(config)
        self.lin = torch.nn.Linear(config.d, config.d)
        self.scale = torch.nn.Parameter(torch.full((config.d,), 0.5))  # a layer scale
        self.gamma = torch.nn.Parameter(torch.ones(config.d))
        self.offset = torch.nn.Parameter(torch.zeros(2, config.d))
        if random_gate:
            self.gate = torch.nn.Parameter(torch.randn(config.d))
        self.post_init()

    def _init_weights(self, module):  # leaves scale, gamma and offset to __init__
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
            torch.nn.init.zeros_(module.bias)


def test_constants_set_in_init_are_followed():
    with torch.device("meta"):
        model = Toy(ToyConfig())
    desc = I.from_module(model)
    assert (desc["scale"].init, desc["gamma"].init, desc["offset"].init) == (I.constant(0.5), I.ones(), I.zeros())
    assert desc["lin"]["weight"].init == I.normal(std=0.02)
    values = I.materialize(desc, seed=0)
    real = Toy(ToyConfig())
    for name in ("scale", "gamma", "offset"):
        assert torch.equal(values[name], getattr(real, name).detach())


def test_a_random_value_set_in_init_is_still_named():
    class RandomGate(Toy):
        def __init__(self, config):
            super().__init__(config, random_gate=True)

    with torch.device("meta"):
        model = RandomGate(ToyConfig())
    with pytest.raises(sf.ShardingError, match=r"params\['gate'\] \(gate, shape \(8,\)\) is left alone by "
                                               r"RandomGate._init_weights and belongs to a RandomGate"):
        I.from_module(model)
