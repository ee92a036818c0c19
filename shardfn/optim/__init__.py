"""Functional optimizers (optax's model) on pytrees of torch tensors, with PyTorch's semantics.

``opt = adamw(1e-3)``; ``state = opt.init(params)``;
``updates, state = opt.update(grads, state, params)``;
``params = apply_updates(params, updates)``. Called on a rank's shards, ``init``
allocates state shaped like the shards, so the optimizer state is sharded like the
parameters. See ``docs/optim.md``.

``optim`` ships inside shardfn and uses the package's own pieces rather than copies:
pytrees are flattened with ``shardfn._tree`` (namespace ``"shardfn"``, spec trees
broadcast by key path), specs are read with ``shardfn._spec``, and a spec tree or mesh
axis that does not fit raises ``sf.SpecError`` (a ``ValueError``). Bad hyperparameters
and update / state trees of different structures raise ``ValueError``, as
``torch.optim`` does; state or params shaped unlike the gradients (state initialised from
the full params, updated with a shard's gradients) raise ``sf.SpecError`` naming the leaves. The transforms import only ``_tree``, ``_spec`` and ``_errors``
(``train_step`` adds ``_autograd``); the mesh given for sharded clipping and Adafactor is
used only through ``mesh.coords``, ``mesh.shape`` and ``mesh.all_reduce``. The
whole-matrix transforms (``muon``, ``soap``) also take ``mesh.group`` and the backend's
uneven all-to-all (``_backend.ops.ragged_all_to_all``): each matrix is gathered to one
owner rank and its update scattered back (``docs/optimizers-sharded.md``). ``shard``
itself is never imported: the caller gives the layout as ``mesh`` and ``specs``
(``step.specs``), and ``train_step`` refuses a whole-matrix transform built without them
on a sharded step.

Pure mode is differentiable by ``torch.func`` (``grad``, ``jacrev``, ``jvp``, ``vmap``) with
respect to gradients, params, state and hyperparameters given as 0-dim tensors
([Note: differentiable pure mode] in ``_flat.py``); ``inject_hyperparams`` keeps the
hyperparameters in the state. ``muon``, ``adafactor`` and ``soap`` are not (they read
norms on the host and run collectives); they have no in-place or fused mode.
"""

from ._adafactor import AdafactorState as AdafactorState
from ._adafactor import adafactor as adafactor
from ._adafactor import adafactor_state_specs as adafactor_state_specs
from ._adam import ScaleByAdamState as ScaleByAdamState
from ._adam import scale_by_adam as scale_by_adam
from ._alias import adam as adam
from ._alias import adamw as adamw
from ._alias import lion as lion
from ._alias import sgd as sgd
from ._clipping import clip_by_global_norm as clip_by_global_norm
from ._clipping import global_norm as global_norm
from ._dpsgd import DPAggregateState as DPAggregateState
from ._dpsgd import dp_aggregate as dp_aggregate
from ._dpsgd import noise_seed as dp_noise_seed
from ._inject import InjectHyperparamsState as InjectHyperparamsState
from ._inject import inject_hyperparams as inject_hyperparams
from ._lion import ScaleByLionState as ScaleByLionState
from ._lion import scale_by_lion as scale_by_lion
from ._momentum import TraceState as TraceState
from ._multi import MaskedState as MaskedState
from ._multi import MultiTransformState as MultiTransformState
from ._multi import masked as masked
from ._multi import multi_transform as multi_transform
from ._multi import set_to_zero as set_to_zero
from ._muon import ScaleByMuonState as ScaleByMuonState
from ._muon import muon as muon
from ._muon import scale_by_muon as scale_by_muon
from ._momentum import trace as trace
from ._scale import ScaleByScheduleState as ScaleByScheduleState
from ._scale import scale as scale
from ._scale import scale_by_learning_rate as scale_by_learning_rate
from ._scale import scale_by_schedule as scale_by_schedule
from ._schedules import Schedule as Schedule
from ._schedules import constant_schedule as constant_schedule
from ._schedules import cosine_decay_schedule as cosine_decay_schedule
from ._schedules import join_schedules as join_schedules
from ._schedules import linear_schedule as linear_schedule
from ._schedules import linear_warmup as linear_warmup
from ._schedules import warmup_cosine_decay_schedule as warmup_cosine_decay_schedule
from ._soap import ScaleBySoapState as ScaleBySoapState
from ._soap import scale_by_soap as scale_by_soap
from ._soap import soap as soap
from ._weight_decay import add_decayed_weights as add_decayed_weights
from .base import AppliedUpdates as AppliedUpdates
from .base import EmptyState as EmptyState
from .base import GradientTransformation as GradientTransformation
from .base import apply_updates as apply_updates
from .base import chain as chain
from .base import identity as identity
from .train import train_step as train_step

__all__ = [
    "AdafactorState",
    "AppliedUpdates",
    "DPAggregateState",
    "EmptyState",
    "GradientTransformation",
    "InjectHyperparamsState",
    "MaskedState",
    "MultiTransformState",
    "Schedule",
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByMuonState",
    "ScaleByScheduleState",
    "ScaleBySoapState",
    "TraceState",
    "adafactor",
    "adafactor_state_specs",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "dp_aggregate",
    "dp_noise_seed",
    "global_norm",
    "identity",
    "inject_hyperparams",
    "join_schedules",
    "lion",
    "linear_schedule",
    "linear_warmup",
    "masked",
    "multi_transform",
    "muon",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_muon",
    "scale_by_schedule",
    "scale_by_soap",
    "set_to_zero",
    "sgd",
    "soap",
    "trace",
    "train_step",
    "warmup_cosine_decay_schedule",
]
