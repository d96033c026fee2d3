"""The distributed optimizer's state for a save, in Megatron's `fully_reshardable` form,
without Megatron's save-time gather.

Megatron-Core 0.16.1 builds that form by allocating fresh zeroed buffers for the whole
state three times over (local shard, all-gather receive, world copy) and copying through
each, on every rank and at every save: 5.5 s of a 100M-parameter model's 7.5 s async-save
stall on CPU, all of it blocking training. The checkpoint holds one tensor per model
parameter and state (`optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`, the
parameter's shape and sharding), and that is all loading needs. So for a save:

- with one data-parallel rank per optimizer, each state tensor already holds a whole
  parameter's state: it is handed over as a reshaped view, no copy;
- with several, each rank copies its shard of every bucket into a reused buffer and DP
  rank 0 gathers them into reused buffers (gloo where the optimizer has a gloo group);
  only DP rank 0 returns state, as Megatron's memory-efficient variant does.

Loading is Megatron's own `fully_reshardable` path, unchanged, so checkpoints from either
side load the same way at any layout. Routed in by `megatron_fixes.optimizer`; a test
(`test_optimizer_save_state_matches_megatron`) compares both implementations tensor for tensor.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
PREFIX = "optimizer.state"


def distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizer instances inside `optimizer` (a ChainedOptimizer or one)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt for opt in inner if isinstance(opt, DistributedOptimizer)]


def sharded_param_state_for_save(opt, model_sharded_state_dict) -> dict | LocalNonpersistentObject:
    """`DistributedOptimizer.sharded_param_state_fully_reshardable(..., is_loading=False)`,
    the same state dict without the triple copy (nothing to save on DP ranks other than 0)."""
    buffers = opt.__dict__.setdefault("_fast_save_buffers", {})  # reused from save to save
    group = _gather_group(opt)
    if group.size() > 1 and group.rank() != 0:
        _send_shards(opt, group, buffers)
        # Megatron returns a plain None here, which lands in this rank's common state dict
        # (rank 0's param_state is all sharded tensors), so every save of a DP > 1 run logged
        # "Rank 1 common state dict differs from rank 0 ... Keys only on 1: [('optimizer',
        # 'param_state')]". A non-persistent None is what Megatron's dp_zero format gives DP
        # ranks > 0: left out of the checkpoint, as the plain None was (only rank 0's common
        # state is written).
        return LocalNonpersistentObject(None)
    metadata_of = {sh.data: sh for sh in nested_values(
        extract_sharded_tensors_and_factories(model_sharded_state_dict)[0])}
    gathered = _gather_shards(opt, group, buffers) if group.size() > 1 else None
    state, param_idx = {}, 0
    for gbuf_idx, buffer in enumerate(opt.buffers):
        for model_param, (start, end, bucket_id) in buffer.param_index_map.items():
            sharded = metadata_of.get(model_param)
            if sharded is None:
                raise ValueError(f"a model parameter of shape {tuple(model_param.shape)} is not in "
                                 "the model's sharded state dict")
            if gathered is None:
                tensors = opt._get_main_param_and_optimizer_states(model_param)
                values = {key: tensors[key].detach() for key in STATE_KEYS}
            else:
                offset = buffer.buckets[bucket_id].offset
                values = {key: gathered[gbuf_idx, bucket_id][key][start - offset:end - offset]
                          for key in STATE_KEYS}
            state[param_idx] = {key: like_model_tensor(sharded, key, value.reshape(sharded.data.shape))
                                for key, value in values.items()}
            param_idx += 1
    return state


def like_model_tensor(sharded, key: str, data: torch.Tensor):
    """The model parameter's ShardedTensor (or factory) for one optimizer state tensor:
    same key suffix, shape, sharding and replica id, as Megatron's format has it."""
    fields = dict(key=f"{PREFIX}.{key}.{sharded.key}", data=data, replica_id=sharded.replica_id)
    if not isinstance(sharded, ShardedTensorFactory):
        fields["dtype"] = data.dtype
    out = replace(sharded, **fields)
    if not isinstance(sharded, ShardedTensorFactory):
        out.validate_metadata_integrity()
    return out


def _gather_group(opt):
    # Gather on CPU through gloo where the optimizer has a gloo group (always on CPU runs);
    # otherwise on the state's own device through its data-parallel group.
    return getattr(opt, "data_parallel_group_gloo", None) or opt.data_parallel_group


def _buffer(buffers: dict, name, numel: int, device) -> torch.Tensor:
    """A reused flat fp32 buffer: allocated (and paged in) by the first save only."""
    buf = buffers.get(name)
    if buf is None or buf.numel() != numel or buf.device != device:
        buf = buffers[name] = torch.zeros(numel, dtype=torch.float32, device=device)
    return buf


def _device(group, opt) -> torch.device:
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return opt.buffers[0].grad_data.device


def _local_shards(opt, group, buffers: dict):
    """(gbuf_idx, bucket_idx, {state key: this rank's contiguous shard of the bucket})."""
    device, dp = _device(group, opt), group.size()
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        (range_maps,) = gbuf_range_maps.values()  # one dtype per buffer, as Megatron asserts
        for bucket_idx, range_map in enumerate(range_maps):
            local = opt.buffers[gbuf_idx].buckets[bucket_idx].grad_data.numel() // dp
            shards = {key: _buffer(buffers, ("send", gbuf_idx, bucket_idx, key), local, device)
                      for key in STATE_KEYS}
            for model_param, param_range in range_map["param_map"].items():
                tensors = opt._get_main_param_and_optimizer_states(model_param)
                where = param_range["gbuf_local"]
                for key in STATE_KEYS:
                    shards[key][where.start:where.end].copy_(tensors[key].detach().view(-1))
            yield gbuf_idx, bucket_idx, shards


def _send_shards(opt, group, buffers: dict) -> None:
    dst = dist.get_global_rank(group, 0)
    for _, _, shards in _local_shards(opt, group, buffers):
        for key in STATE_KEYS:
            dist.gather(shards[key], None, dst=dst, group=group)


def _gather_shards(opt, group, buffers: dict) -> dict:
    """On DP rank 0: {(gbuf_idx, bucket_idx): {state key: the whole bucket's state}}."""
    dst, dp = dist.get_global_rank(group, 0), group.size()
    out = {}
    for gbuf_idx, bucket_idx, shards in _local_shards(opt, group, buffers):
        whole = {}
        for key in STATE_KEYS:
            local = shards[key]
            world = _buffer(buffers, ("recv", gbuf_idx, bucket_idx, key), local.numel() * dp, local.device)
            dist.gather(local, list(world.view(dp, -1).unbind(0)), dst=dst, group=group)
            whole[key] = world
        out[gbuf_idx, bucket_idx] = whole
    return out
