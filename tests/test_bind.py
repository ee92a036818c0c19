"""shardfn/_bind.py: Binding == torch.func.functional_call, ties included; the module is left as it was."""

import pytest
import torch
from torch import nn

from shardfn._bind import Binding


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.mid = nn.Linear(3, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx))))


def test_binding_equals_functional_call_with_ties():
    torch.manual_seed(0)
    model = Tied()
    names = ["emb.weight", "mid.weight", "mid.bias"]  # the tied head once, as sf.functional's tree has it
    values = [torch.randn(5, 3), torch.randn(3, 3), torch.randn(3)]
    idx = torch.tensor([[0, 3, 4]])
    want = torch.func.functional_call(model, dict(zip(names, values)), (idx,))
    binding = Binding(model, names)
    assert [len(s) for s in binding.slots] == [2, 1, 1]  # emb.weight also fills head.weight
    got = binding.call(values, (idx,), {})
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the module's own Parameters are back, and its own forward unchanged
    assert isinstance(model.emb.weight, nn.Parameter) and model.head.weight is model.emb.weight
    torch.testing.assert_close(binding.call(list(dict(model.named_parameters()).values()), (idx,), {}), model(idx))


def test_binding_restores_the_parameters_when_the_call_raises():
    model = Tied()
    before = dict(model.named_parameters(remove_duplicate=False))
    binding = Binding(model, ["emb.weight"])
    with pytest.raises(IndexError):
        binding.call([torch.zeros(5, 3)], (torch.tensor([[7]]),), {})  # out of the vocabulary
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)


def test_binding_gradients_flow_to_the_bound_values():
    model = Tied()
    w = torch.randn(5, 3, requires_grad=True)
    out = Binding(model, ["emb.weight"]).call([w], (torch.tensor([[1, 2]]),), {})
    (g,) = torch.autograd.grad(out.sum(), [w])
    want = torch.func.grad(lambda w: torch.func.functional_call(model, {"emb.weight": w},
                                                                (torch.tensor([[1, 2]]),)).sum())(w.detach())
    torch.testing.assert_close(g, want)
