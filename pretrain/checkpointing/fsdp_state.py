"""Megatron-FSDP (ZeRO-2/3, HSDP) model and optimizer state in this project's checkpoint format.

A ZeRO-2/3 checkpoint holds the same tensors, under the same keys, as a plain DDP run's:
the model's torch_dist weights (GPTModel.sharded_state_dict) and the optimizer state in
Megatron's `fully_reshardable` form (`optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`,
one tensor per model parameter, its TP sharding; `optimizer.param_groups` with the Adam step
in the common state). So it resumes at any layout, ZeRO or not, and checkpoints_tools read it
as they read any checkpoint; a DDP checkpoint resumes under ZeRO-2/3 the same way.

Saving: every bucket is all-gathered so the module's raw parameters hold this TP rank's full
tensors (`gathered`), the model's sharded state dict is taken as for DDP, and each optimizer
tensor (this rank's flat piece of a parameter: Megatron-FSDP shards the flattened buckets
unevenly) is gathered over the shard group onto the rank that writes it (data-parallel rank
0, as Megatron's own fully_reshardable save does). Loading reads each parameter's full
TP-local tensors on every rank and keeps this rank's piece.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import is_main_replica
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

from pretrain.megatron_fixes.optimizer_save import STATE_KEYS, like_model_tensor


def is_fsdp_chunk(chunk) -> bool:
    return hasattr(chunk, "param_and_grad_buffer")


def is_fsdp(run_state) -> bool:
    return is_fsdp_chunk(run_state.model[0])


def inner_models(run_state) -> list:
    """The GPTModels inside the FullyShardedDataParallel wrappers (FSDP -> MegatronFSDP -> GPTModel)."""
    return [chunk.module.module for chunk in run_state.model]


@contextlib.contextmanager
def gathered(run_state):
    """Within: the raw parameters hold this TP rank's full tensors (every bucket all-gathered),
    and the modules' state_dict hooks leave them in place."""
    for chunk in run_state.model:
        fsdp = chunk.module
        fsdp.start_param_sync(force_sync=True)
        # The forced sync ends by putting the DTensor main weights back on the module
        # (megatron_fsdp.py:1156-1161): use the raw, gathered parameters instead, and mark
        # them "distributed" so the state_dict pre-hooks (megatron_fsdp.py:1039) keep them.
        fsdp._replace_param_with_raw_if_needed()
        fsdp.is_param_fsdp_distributed = True
    try:
        yield inner_models(run_state)
    finally:
        for chunk in run_state.model:
            fsdp = chunk.module
            fsdp.is_param_fsdp_distributed = False
            fsdp.all_gather_pipeline.reset()  # ZeRO-3: frees the gathered buckets
            fsdp._replace_param_with_distributed_if_needed()


@dataclass
class _Item:
    """One parameter of a chunk, with where its optimizer shard sits in the flattened tensor."""

    name: str
    raw: torch.Tensor  # the module's raw parameter (full TP-local tensor while gathered)
    main: torch.Tensor  # the optimizer's DTensor parameter (fp32 main weights)
    group: object  # Megatron-FSDP parameter group
    item_id: int

    def piece(self) -> tuple[int, int]:
        return self.group.main_grad_buffer._get_item_slice_in_shard(self.item_id)

    @property
    def shard_group(self):
        return self.group.main_grad_buffer.data_parallel_group


def _items(chunk) -> list[_Item]:
    pgb = chunk.param_and_grad_buffer
    main = dict(pgb.optimizer_named_parameters)
    raw = chunk.module.raw_param
    items = []
    for group in pgb.parameter_groups:
        for item_id, param in enumerate(group.params):
            name = pgb.param_to_name[param]
            items.append(_Item(name, raw[name], main[name], group, item_id))
    return items


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def _ensure_adam_state(optimizer) -> None:
    """Adam state for every parameter: torch creates it at a parameter's first update, and a
    parameter whose uneven shard is empty on a rank never gets a gradient there."""
    optimizer.init_state_fn(optimizer.optimizer, optimizer.config)


def _adam_step(optimizer) -> float:
    steps = {float(s["step"]) for s in optimizer.optimizer.state.values() if "step" in s}
    steps = torch.tensor([max(steps) if steps else 0.0], dtype=torch.float64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # ranks whose shards saw no update have none
    return float(steps.item())


def _common(optimizer) -> dict:
    """What DistributedOptimizer.state_dict() holds (param groups with the Adam step)."""
    step = _adam_step(optimizer)
    groups = []
    for group in optimizer.optimizer.param_groups:
        meta = {k: v for k, v in group.items() if k != "params"}
        meta["step"] = step
        groups.append(meta)
    common = {"optimizer": {"param_groups": groups}}
    if optimizer.grad_scaler:
        common["grad_scaler"] = optimizer.grad_scaler.state_dict()
    return common


def _model_tensors(model_sd: dict) -> dict:
    """{raw parameter tensor: its model ShardedTensor (or SwiGLU factory)}."""
    found = nested_values(extract_sharded_tensors_and_factories(model_sd)[0])
    return {sh.data: sh for sh in found}


def optimizer_state_for_save(run_state, model_sd: dict) -> dict:
    """The fully_reshardable optimizer state dict (call while `gathered`).

    Rank 0 of each parameter's shard group (the data-parallel group, the expert data-parallel
    group for experts, the replica's group under HSDP) gathers the full TP-local tensors.
    Every other rank lists the same tensors as zero-stride placeholders: the structure is then
    identical on every rank (Megatron compares the non-tensor part across ranks), and the
    save keeps only main replicas (`keep_only_main_replica`), which the model's replica ids
    put on gathering ranks (checked)."""
    optimizer = run_state.optimizer

    def tensors(item: _Item, sharded) -> dict:
        adam = optimizer.optimizer.state[item.main]
        pieces = {"param": _local(item.main), "exp_avg": _local(adam["exp_avg"]),
                  "exp_avg_sq": _local(adam["exp_avg_sq"])}
        full = _gather_full(item, pieces)
        shape = sharded.data.shape
        if not full and is_main_replica(sharded.replica_id):
            raise RuntimeError(f"{sharded.key}: this rank holds the main replica but is not rank 0 of its "
                               "Megatron-FSDP shard group, so it has no full optimizer state to save")
        placeholder = torch.empty(1, dtype=torch.float32).expand(shape)
        return {key: full[key].view(shape) if full else placeholder for key in STATE_KEYS}

    return _optimizer_state(run_state, model_sd, tensors)


def _gather_full(item: _Item, pieces: dict) -> dict:
    """{key: the parameter's full TP-local flat tensor} on shard-group rank 0 ({} elsewhere)."""
    group, start_end = item.shard_group, item.piece()
    mine = (start_end, {k: v.detach().reshape(-1).cpu() for k, v in pieces.items()})
    everyone = [None] * group.size() if group.rank() == 0 else None
    dist.gather_object(mine, everyone, dst=dist.get_global_rank(group, 0), group=group)
    if everyone is None:
        return {}
    numel = item.raw.numel()
    full = {k: torch.empty(numel, dtype=torch.float32) for k in pieces}
    for (start, end), values in everyone:
        for key, value in values.items():
            full[key][start:end] = value
    return full


def optimizer_state_for_load(run_state, model_sd: dict) -> dict:
    """What `dist_checkpointing.load` fills: every parameter's full TP-local optimizer tensors
    (on every rank), and the common part (call while `gathered`)."""
    def tensors(item: _Item, sharded) -> dict:
        return {key: torch.empty(sharded.data.shape, dtype=torch.float32) for key in STATE_KEYS}

    return _optimizer_state(run_state, model_sd, tensors)


def _optimizer_state(run_state, model_sd: dict, tensors) -> dict:
    """The fully_reshardable optimizer state dict: the common part, and per parameter (in
    `_items` order) `tensors(item, model ShardedTensor)` wrapped like the model's tensor."""
    optimizer = run_state.optimizer
    _ensure_adam_state(optimizer)
    state = _common(optimizer)
    model_tensor = _model_tensors(model_sd)
    param_state, index = {}, 0
    for chunk in run_state.model:
        for item in _items(chunk):
            sharded = model_tensor[item.raw]
            param_state[index] = {key: like_model_tensor(sharded, key, value)
                                  for key, value in tensors(item, sharded).items()}
            index += 1
    state["param_state"] = param_state
    state["param_state_sharding_type"] = "fully_reshardable"
    return state


@torch.no_grad()
def load_model(run_state, loaded_models: list[dict]) -> None:
    """Loaded model weights -> the raw parameters -> Megatron-FSDP's weight buffers (while
    `gathered`). Not load_state_dict: its FSDP post-hook (megatron_fsdp.py:1032) would copy
    the old main weights back over them."""
    for chunk, model, loaded in zip(run_state.model, inner_models(run_state), loaded_models):
        params = dict(model.named_parameters())
        for name, tensor in loaded.items():
            if name in params:  # `_extra_state` entries are not parameters
                params[name].data.copy_(tensor)
        for item in _items(chunk):
            for buffer in (item.group.model_weight_buffer, item.group.main_weight_buffer):
                if buffer is not None:
                    buffer.set_item(item.item_id, item.raw.detach())


@torch.no_grad()
def load_optimizer(run_state, loaded: dict) -> None:
    """This rank's pieces of the loaded optimizer tensors -> fp32 main weights and Adam state;
    the Adam step from the param groups (call while `gathered`, after load_model). `loaded`
    has the structure optimizer_state_for_load built."""
    optimizer = run_state.optimizer
    step = loaded["optimizer"]["param_groups"][0].get("step", 0)
    index = 0
    for chunk in run_state.model:
        for item in _items(chunk):
            start, end = item.piece()
            adam = optimizer.optimizer.state[item.main]
            targets = {"param": _local(item.main), "exp_avg": _local(adam["exp_avg"]),
                       "exp_avg_sq": _local(adam["exp_avg_sq"])}
            for key, target in targets.items():
                target.view(-1).copy_(loaded["param_state"][index][key].reshape(-1)[start:end])
            adam["step"] = torch.tensor(float(step))
            index += 1
        chunk.param_and_grad_buffer.copy_main_weights_to_model_weights()
