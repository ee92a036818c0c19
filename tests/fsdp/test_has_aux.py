"""One has_aux rule ([Note: one has_aux rule] in shardfn/optim/train.py): an sf.shard step
says whether its loss returns (loss, aux); sf.train_step (and sf.jit) read it there."""

import torch

import shardfn as sf


def _loss(params, batch):
    x, y = batch
    err = x @ params["w"] - y
    return (err ** 2).mean(), {"max_err": err.abs().max().detach()}


def _run(mesh, **train_kwargs):
    step = sf.shard(_loss, mesh, has_aux=True)
    opt = sf.optim.sgd(0.1)
    shards = step.shard_params({"w": torch.ones(4, 2, dtype=torch.float64)})
    x = torch.arange(16.0, dtype=torch.float64).reshape(4, 4) / 16
    train = sf.train_step(step, opt, **train_kwargs)
    return train(shards, opt.init(shards), (x, torch.zeros(4, 2, dtype=torch.float64)))


def test_train_step_reads_has_aux_from_the_shard_step():
    mesh = sf.local_mesh({"data": 2})
    for out in mesh.run(lambda: _run(mesh)):
        shards, state, loss, aux = out
        assert set(aux) == {"max_err"} and aux["max_err"].dtype == torch.float64
        assert loss.ndim == 0


def test_train_step_has_aux_that_contradicts_the_step_is_refused():
    mesh = sf.local_mesh({"data": 2})
    for result in mesh.run(lambda: _catch(lambda: _run(mesh, has_aux=False))):
        assert result.startswith("train_step(has_aux=False): this step was built with sf.shard(..., has_aux=True)")
        assert "Fix: leave train_step's has_aux out" in result
    for out in mesh.run(lambda: _run(mesh, has_aux=True)):  # agreeing is fine
        assert len(out) == 4


def _catch(fn):
    try:
        fn()
    except sf.SpecError as e:
        return str(e)
    return None


def test_a_plain_function_keeps_train_steps_argument():
    params = {"w": torch.ones(4, 2, dtype=torch.float64)}
    opt = sf.optim.sgd(0.1)
    batch = (torch.eye(4, dtype=torch.float64), torch.zeros(4, 2, dtype=torch.float64))
    assert len(sf.train_step(_loss, opt, has_aux=True)(params, opt.init(params), batch)) == 4
    plain = sf.train_step(lambda p, b: _loss(p, b)[0], opt)  # None: False for a plain function
    assert len(plain(params, opt.init(params), batch)) == 3
