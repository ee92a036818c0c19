"""The composition matrix: every `shard` option under every entry point, generated from
the one table ([Note: the composition table] in shardfn/_fsdp/support.py).

Each cell on the MLP (tests/composition_cases.py) is equal to its reference or refused by
the table's own error. sf.jit's supported cells need processes (the traced step runs on
the distributed backend only): they run in the slow set, bit for bit against eager
`sf.train_step` with the same option (aot_eager); its refused cells are checked here on
the simulated mesh, where sf.jit checks the options before the backend.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

import shardfn as sf
from shardfn._fsdp import support
from shardfn.testing import run_multiprocess

import composition_cases as cases

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "composition.md"


@pytest.fixture(autouse=True, scope="module")
def _release_meshes():
    yield
    cases.release()


@pytest.mark.parametrize("option, entry", cases.CELLS, ids=[f"{o}-{e}" for o, e in cases.CELLS])
def test_every_cell_on_the_mlp_is_right_or_refused_by_the_table(option, entry):
    assert cases.run_cell(option, entry) == []


LEAN_PAIR_ENTRIES = ("train_step",)  # `make test`; every entry point in `make test-all`
PAIR_CELLS = [(pair, e) for pair in cases.PAIRS for e in cases.ENTRY_KEYS]


@pytest.mark.parametrize("pair, entry", [c for c in PAIR_CELLS if c[1] in LEAN_PAIR_ENTRIES],
                         ids=[f"{'+'.join(p)}-{e}" for p, e in PAIR_CELLS if e in LEAN_PAIR_ENTRIES])
def test_every_pair_of_options_on_the_mlp_lean(pair, entry):
    assert cases.run_cell(pair, entry) == []


@pytest.mark.slow
@pytest.mark.parametrize("pair, entry", [c for c in PAIR_CELLS if c[1] not in LEAN_PAIR_ENTRIES],
                         ids=[f"{'+'.join(p)}-{e}" for p, e in PAIR_CELLS if e not in LEAN_PAIR_ENTRIES])
def test_every_pair_of_options_on_the_mlp(pair, entry):
    assert cases.run_cell(pair, entry) == []


def test_the_pairs_cover_every_pair_one_step_can_have():
    """73 of the 78 pairs of the 13 options; the 5 left out set one argument twice or bring
    two data-axis layouts (named here, so a new option's conflicts are decided, not lost)."""
    options = [o for o in cases.SETUPS if o != "none"]
    left_out = {(a, b) for i, a in enumerate(options) for b in options[i + 1:]} - set(cases.PAIRS)
    assert left_out == {("wire_int8", "wire_fp8"), ("wire_int8", "wire_cast"), ("wire_fp8", "wire_cast"),
                        ("hsdp", "hpz"), ("hpz", "no_reshard")}


def test_remat_reads_a_block_split_over_units_together():
    """sf.remat read a block's leaves one by one: a block whose bias is frozen (a unit of its
    own) freed that unit when the block's other unit was entered, and the block then read
    freed memory (a segfault). Now the leaves are read in one `together` scope."""
    for entry in ("call", "func_grad", "hvp_rev"):
        assert cases.run_cell(("frozen", "remat"), entry) == []


MODEL_CELLS = [(m, o, e) for m in ("gpt", "llama") for o, e in cases.CELLS if (o, e) != ("tp", e)]


@pytest.mark.slow
@pytest.mark.parametrize("model, option, entry", MODEL_CELLS, ids=[f"{m}-{o}-{e}" for m, o, e in MODEL_CELLS])
def test_every_cell_on_the_examples_gpt_and_a_transformers_llama(model, option, entry):
    """The examples' GPT (2 layers, d16, tied head) and a transformers Llama (2 layers, d16,
    GQA, tied embeddings) through sf.functional, fp64, the loss from the logits in fp64."""
    problems = cases.run_cell(option, entry, model)
    known = cases.KNOWN.get((model, option, entry))
    if known is not None:  # raised on every rank, by a clear error
        assert problems and all(known in p for p in problems), problems
        return
    assert problems == []


@pytest.mark.slow
@pytest.mark.ci
def test_a_lean_set_of_cells_on_the_gpt_and_the_llama():
    for model in ("gpt", "llama"):
        for option, entry in (("none", "train_step"), ("wire_int8", "func_grad"), ("hsdp", "hvp"),
                              ("no_reshard", "estimate"), ("global_mean", "accumulate:reduce_once")):
            assert cases.run_cell(option, entry, model) == [], (model, option, entry)


def test_the_table_covers_every_option_and_entry_the_matrix_runs():
    assert {o.key for o in support.OPTIONS} == set(cases.SETUPS)
    assert {e.key for e in support.ENTRIES} == {e.partition(":")[0] for e in cases.ENTRY_KEYS}
    for entry, option in support.REFUSED:
        assert support.cell(entry, option) is not None
    with pytest.raises(KeyError, match="no cell"):
        support.cell("jit", "no such option")


def test_the_docs_page_is_the_table():
    page = DOCS.read_text()
    assert support.markdown() in page, (
        "docs/composition.md is not the table in shardfn/_fsdp/support.py; regenerate it with "
        "`python scripts/gen_composition_docs.py`")


def test_a_refusal_names_every_refused_option_the_reasons_and_the_fix(monkeypatch):
    # sf.jit supports every option now: the messages are checked on planted refusals
    eager = "train eagerly with sf.train_step(step, opt), which supports it"
    monkeypatch.setitem(support.REFUSED, ("jit", "tp"), support.Refusal("a planted reason", eager))
    message = str(support.refusal("jit", ["hpz", "tp", "check_finite", "prefetch"]))
    assert message.startswith("sf.jit(step, opt) does not support param_specs=... (FSDP x TP): a planted "
                              "reason.\n"), message
    assert "hpZ" not in message and "prefetch=2" not in message and "check_finite" not in message  # supported
    message = str(support.refusal("jit", ["tp"]))
    assert "Fix: drop the option, or train eagerly with sf.train_step(step, opt)" in message
    # several refused options: one line each
    monkeypatch.setitem(support.REFUSED, ("jit", "hpz"), support.Refusal("a second planted reason", "a planted fix"))
    message = str(support.refusal("jit", ["hpz", "tp"]))
    assert "Fix: drop the option, or a planted fix; or train eagerly with sf.train_step" in message
    assert message.startswith("sf.jit(step, opt) does not support these options of the step:\n")
    assert "  - reshard_after_forward=<inner shard axes> (hpZ): a second planted reason" in message
    assert "  - param_specs=... (FSDP x TP): a planted reason" in message
    assert support.refusal("jit", ["prefetch", "none"]) is None


def test_the_matrix_catches_a_wrong_gradient_and_a_wrong_refusal(monkeypatch):
    setup = cases.SETUPS["none"]
    params = cases.mlp_params()
    _, whole = cases.global_batch(setup, 2)
    grads, loss = cases.reference(setup, params, whole, "grads")
    # a gradient scaled by the world size (a forgotten 1/N) is caught
    wrong = {"loss": loss, "grads": sf._tree.tree_map(lambda g: 2 * g, grads)}
    problems = cases._compare(setup, params, whole, "grad_and_value", wrong, {})
    assert len(problems) == 1 and problems[0].startswith("grads off by 1 ")
    # a refusal the table does not list fails the cell; so does a cell the table refuses that runs
    monkeypatch.setitem(support.REFUSED, ("grad_and_value", "prefetch"), support.Refusal("planted", "none"))
    assert cases.run_cell("prefetch", "grad_and_value")[0].startswith("expected the table's refusal")


def test_vmap_over_the_batch_with_global_mean_is_the_tables_refusal():
    problems = cases.run_cell("global_mean", "vmap")
    assert problems == []
    assert "vmap over the batch hides each rank's batch size" in str(support.refusal("vmap", ["global_mean"]))


def test_accumulate_with_global_mean_weighs_micro_batches_by_their_global_size():
    """Uneven micro-batches (rank r: 4 + r examples, split 2 / 2 + r): the mean over the
    step's global examples, as one big batch (it was the mean of the micro-batch means)."""
    for mode in ("reduce_each", "reduce_once"):
        assert cases.run_cell("global_mean", f"accumulate:{mode}") == []


def test_estimate_with_check_finite_counts_the_flag_all_reduces():
    est = sf.estimate(cases.make_loss(), cases.mlp_params(), (torch.Size([4, cases.D]), torch.Size([4, 1])),
                      {"data": 2}, dtype=torch.float64, check_finite=True)
    plain = sf.estimate(cases.make_loss(), cases.mlp_params(), (torch.Size([4, cases.D]), torch.Size([4, 1])),
                        {"data": 2}, dtype=torch.float64)
    units = cases.BLOCKS + 1
    assert est.all_reduce_bytes - plain.all_reduce_bytes == 4 * (units + 1)  # a float32 flag per unit and the loss
    assert est.num_collectives - plain.num_collectives == units + 1


# -- sf.jit on processes ---------------------------------------------------------------------

JIT_SUPPORTED = [o.key for o in support.OPTIONS if support.cell("jit", o.key) is None]


def _jit_vs_eager(option, steps: int = 3):
    """`option`: a key of `cases.SETUPS`, or a `cases.Setup` of its own."""
    setup = cases.SETUPS[option] if isinstance(option, str) else option
    mesh = sf.init_mesh(dict(setup.mesh_shape), timeout=60)
    step = sf.shard(cases.make_loss(tp=setup.tp, remat=setup.remat), mesh, **setup.shard_kwargs)
    index, size = cases.data_rank(mesh, setup)
    parts, _ = cases.global_batch(setup, size)
    try:
        return cases.traced_against_eager(step, parts[index], steps)
    except sf.SpecError as e:
        return {"refused": str(e)}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("option", JIT_SUPPORTED + ["remat"])
def test_jit_cells_on_processes_equal_eager_train_step_bit_for_bit(option):
    for out in run_multiprocess(_jit_vs_eager, 2 if len(cases.SETUPS[option].mesh_shape) == 1 else 4, option,
                                timeout=240):
        refusal = support.cell("jit", option)
        if refusal is not None:
            assert str(support.refusal("jit", [option])) in out.get("refused", ""), out
            continue
        assert "refused" not in out, out["refused"]
        assert out["losses"] == out["eager_losses"]
        assert out["equal"]
        # the traced step skips the last unit's re-gather ([Note: the last unit] in _traced/): fewer bytes
        assert out["bytes"][1:] == out["eager_bytes"][1:]  # reduce-scatter, all-reduce (loss, HSDP replicas)
        assert out["bytes"][0] <= out["eager_bytes"][0]
        # resharded after the forward: every block but the last is gathered again in the backward (a bf16
        # all-gather's decode once hid its buffer from the schedule pass, which kept it alive instead)
        assert out["backward_gathers"] == (0 if option == "no_reshard" else cases.BLOCKS - 1), out


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.multiprocess
def test_jit_with_int8_both_ways_communicates_int8_and_equals_eager():
    """What the table replaced: sf.jit with an int8 wire communicated in fp32, silently."""
    test_jit_cells_on_processes_equal_eager_train_step_bit_for_bit("wire_int8")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("wire", ["int8", torch.float8_e4m3fn])
def test_jit_with_a_bf16_reduce_and_a_quantized_reduce_scatter_equals_eager_bit_for_bit(wire):
    """qgZ decodes each received row straight into float32 and sums there (`qgz.decoded_sum`).
    The traced step decoded into the bf16 reduce dtype first, then summed in float32: its
    parameters drifted 3.0e-5 / 1.2e-4 from eager's after 3 AdamW steps, silently (the
    matrix's options reduce in float32, where the two roundings agree)."""
    mp = sf.MixedPrecision(reduce_dtype=torch.bfloat16, reduce_scatter_dtype=wire)
    setup = cases.Setup((("data", 2),), {"mixed_precision": mp})
    for out in run_multiprocess(_jit_vs_eager, 2, setup, timeout=240):
        assert "refused" not in out, out["refused"]
        assert out["losses"] == out["eager_losses"]
        assert out["equal"], out["gap"]
        assert out["bytes"][1:] == out["eager_bytes"][1:]


def test_jit_refuses_a_float8_wire_with_inductor_and_names_the_fixes():
    mesh = cases._mesh((("data", 2),))
    step = sf.shard(cases.make_loss(), mesh, mixed_precision=sf.MixedPrecision(all_gather_dtype=torch.float8_e4m3fn))
    with pytest.raises(sf.SpecError, match=r"(?s)all_gather_dtype=torch.float8_e4m3fn\) with backend='inductor'.*"
                                           r"Fix: sf.jit\(step, opt, backend='aot_eager'\).*'int8' wire"):
        sf.jit(step, sf.optim.sgd(0.1))
    sf.jit(step, sf.optim.sgd(0.1), backend="aot_eager")  # accepted


def test_an_accumulate_that_raises_leaves_no_held_gradient_for_the_next_step():
    """accumulate(mode="reduce_once") holds each unit's gradient sum until its last
    micro-batch; one that raised before it left the sums on the units, and the next step
    added them into its gradient (0.57 off, silently)."""
    mesh = cases._mesh((("data", 2),))
    setup = cases.SETUPS["none"]
    step = sf.shard(cases.make_loss(), mesh)

    def body():
        parts, _ = cases.global_batch(setup, 2)
        x, y = parts[mesh.rank]
        shards = step.shard_params(cases.mlp_params())
        want, _ = step.grad_and_value(shards, (x, y))
        bad = (x[:, :3], y)  # the second micro-batch fails inside loss_fn
        with pytest.raises(RuntimeError):
            step.accumulate(shards, [(x, y), bad], mode="reduce_once")
        got, _ = step.grad_and_value(shards, (x, y))
        return all(torch.equal(a, b) for a, b in zip(sf._tree.flatten(got)[0], sf._tree.flatten(want)[0]))

    assert mesh.run(body) == [True, True]


def _unrolled(steps, shards, batch, lr):
    """The loss after len(steps) - 1 SGD steps, each through its own step, differentiable."""
    for step in steps[:-1]:
        grads = torch.func.grad(step)(shards, batch)
        shards = sf._tree.tree_map(lambda p, g: p - lr * g, shards, grads)
    return steps[-1](shards, batch)


def test_a_gradient_through_two_calls_with_other_shards_is_refused_and_one_step_per_call_is_right():
    """The backward of an earlier call re-gathered the later call's shards into the unit's one
    buffer ([Note: one call's backward at a time]): a meta-gradient through two SGD steps
    of one step was silently wrong. Refused now; one step per call is right (fp64)."""
    mesh = cases._mesh((("data", 2),))
    setup = cases.SETUPS["none"]
    params = cases.mlp_params()
    loss_fn = cases.make_loss()
    parts, whole = cases.global_batch(setup, 2)
    lr = torch.tensor(0.1, dtype=torch.float64)
    want = torch.func.grad(lambda lr: _unrolled([loss_fn] * 3, params, whole, lr))(lr)
    one = sf.shard(loss_fn, mesh)
    per_call = [sf.shard(loss_fn, mesh) for _ in range(3)]

    def body():
        batch = parts[mesh.rank]
        shards = one.shard_params(params)
        with pytest.raises(sf.ShardingError, match=r"(?s)the backward of an earlier call of this step runs "
                                                   r"after a later call with other shards.*one sf.shard step per call"):
            torch.func.grad(lambda lr: _unrolled([one] * 3, shards, batch, lr))(lr)
        for step in per_call:
            step.shard_params(params)  # lays out the tree for each step
        return torch.func.grad(lambda lr: _unrolled(per_call, shards, batch, lr))(lr)

    got = mesh.run(body)
    # lr scales every rank's shards: the hypergradient is the sum of the ranks' parts
    total = float(got[0] + got[1])
    assert abs(total - float(want)) <= 1e-10 * abs(float(want)), (total, float(want))
