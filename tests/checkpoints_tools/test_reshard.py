"""reshard: TP2xPP2 -> TP1 -> TP4 keeps the logits; the trainer resumes every output."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from models.runtime import DTYPES
from checkpoints_tools.dcp_io import CheckpointReader
from checkpoints_tools.import_hf import import_hf
from checkpoints_tools.reshard import reshard
from models.layout import ParallelLayout
from tests.checkpoints_tools.conftest import BASE
from tests.checkpoints_tools.workers import first
from tests.distributed import run_ranks

pytestmark = [pytest.mark.distributed]


def _chunks_per_layer(path, key: str) -> int:
    md = CheckpointReader(path).metadata.state_dict_metadata[key]
    return sum(1 for c in md.chunks if c.offsets[0] == 0)


def test_chain_tp2pp2_to_tp1_to_tp4_keeps_logits(trained, tmp_path):
    run = trained["tied"]  # 4 query groups: TP4 is a valid target
    tp1, tp4 = tmp_path / "tp1", tmp_path / "tp4"
    one = reshard(run.latest, tp1, layout=ParallelLayout())
    four = reshard(tp1, tp4, layout=ParallelLayout(tensor_parallel=4), drop_optimizer=True)
    assert (one["source_layout"], one["layout"], one["optimizer"]) == ("TP2xPP2xDP1", "TP1xPP1xDP1", True)
    assert (four["layout"], four["optimizer"]) == ("TP4xPP1xDP1", False)
    meta = json.loads((tp4 / "meta.json").read_text())
    assert meta["layout"]["tensor_parallel"] == 4 and meta["has_optimizer"] is False and meta["step"] == 3
    # Whose optimizer state a kept one is (a resume with another optimizer is refused); none when dropped.
    assert json.loads((tp1 / "meta.json").read_text())["optimizer"] == "adamw" and meta["optimizer"] is None
    assert (tp4 / "COMPLETE").is_file() and not any(k.startswith("optimizer.") for k in CheckpointReader(tp4).tensor_keys())
    # Cut for the target: per layer, 4 TP chunks of QKV, gate and up halves of fc1 each in 4.
    assert _chunks_per_layer(tp4, "decoder.layers.self_attention.linear_qkv.weight") == 4
    assert _chunks_per_layer(tp4, "decoder.layers.mlp.linear_fc1.weight") == 8
    assert _chunks_per_layer(tp1, "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight") == 2
    with ThreadPoolExecutor(2) as pool:  # both loads at once: most of each is process start-up
        at_tp1 = pool.submit(run_ranks, 1, "tests.checkpoints_tools.workers:checkpoint_logits",
                             checkpoint=str(tp1), layout={})
        at_tp4 = pool.submit(run_ranks, 4, "tests.checkpoints_tools.workers:checkpoint_logits",
                             checkpoint=str(tp4), layout={"tensor_parallel": 4})
        logits = {"TP1": torch.tensor(first(at_tp1.result())), "TP4": torch.tensor(first(at_tp4.result()))}
    for name, got in logits.items():
        diff = (got - run.logits).abs().max().item()
        assert diff <= 1e-6, f"{name}: max |logit difference| to the TP2xPP2 original {diff}"


def _resume(recipe, overrides, checkpoint, tmp_path, tag, config_file=None) -> dict:
    overrides = [*overrides, "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1",
                 f"checkpoint.resume={checkpoint}", f"checkpoint.dir={tmp_path / tag}",
                 f"logging.run_dir={tmp_path / (tag + '-run')}"]
    return {"recipe": recipe, "overrides": overrides, "config_file": config_file}


def test_trainer_resumes_resharded_and_imported_checkpoints(trained, hf_models, tmp_path):
    """Step 3 from the step-2 checkpoint resharded to TP1 (with optimizer state, and as a
    model-only copy) has the loss the TP2xPP2 run had at step 3: the forward
    pass of step 3 sees the same weights and the same batch. An HF import continues too."""
    run = trained["tied"]
    step2 = run.root / "step_00000002"
    with_optimizer, model_only = tmp_path / "full", tmp_path / "model-only"
    reshard(step2, with_optimizer, layout=ParallelLayout())
    reshard(step2, model_only, layout=ParallelLayout(), drop_optimizer=True, dtype=DTYPES["fp32"])
    imported = tmp_path / "imported"
    import_hf(hf_models["llama"], imported, layout=ParallelLayout(tensor_parallel=2))
    jobs = [
        _resume(run.recipe, run.overrides, with_optimizer, tmp_path, "a"),
        _resume(run.recipe, run.overrides, model_only, tmp_path, "b"),
        # The documented way to continue an import: its config.yaml (the model from
        # config.json) over a recipe, plus data and schedule choices.
        _resume("tiny-llama", BASE + ["schedule.train_steps=2", "data.tokenizer=null"], imported, tmp_path, "c",
                config_file=str(imported / "config.yaml")),
    ]
    losses = run_ranks(1, "tests.checkpoints_tools.workers:resume_jobs", jobs=jobs, rendezvous=str(tmp_path))[0]
    expected = run.losses[2]
    assert losses[0] == pytest.approx([expected], rel=1e-5), "resume with optimizer state"
    assert losses[1] == pytest.approx([expected], rel=1e-5), "resume model-only (fresh optimizer)"
    assert len(losses[2]) == 2 and all(loss == loss and loss < 20 for loss in losses[2])


def test_moe_ep2_to_ep1_keeps_experts_and_optimizer_state(trained, tmp_path):
    """MoE: the chained (dense + expert) optimizer state is kept, or dropped, as a whole;
    a dtype cast touches the weights, never the fp32 optimizer state."""
    run = trained["moe"]
    full, serving = tmp_path / "full", tmp_path / "serving"
    assert reshard(run.latest, full, layout=ParallelLayout(), dtype=DTYPES["bf16"])["optimizer"]
    assert not reshard(run.latest, serving, layout=ParallelLayout(), drop_optimizer=True)["optimizer"]
    source, kept, dropped = (CheckpointReader(p) for p in (run.latest, full, serving))
    optimizer = [k for k in source.tensor_keys() if k.startswith("chained_")]
    assert any(k.startswith("chained_1.") and ".experts." in k for k in optimizer)
    assert set(kept.tensor_keys()) == set(source.tensor_keys())
    assert set(dropped.tensor_keys()) == set(source.tensor_keys()) - set(optimizer)
    assert all(kept.dtype(k) == torch.float32 for k in optimizer)
    assert kept.dtype("decoder.layers.mlp.experts.experts.linear_fc1.weight") == torch.bfloat16
    # Every expert's weights moved unchanged from the EP2 layout.
    for key in ("decoder.layers.mlp.experts.experts.linear_fc2.weight", "decoder.layers.mlp.router.weight"):
        assert torch.equal(source.read(key, (3,)), dropped.read(key, (3,)))
    got = torch.tensor(first(run_ranks(1, "tests.checkpoints_tools.workers:checkpoint_logits",
                                       checkpoint=str(serving), layout={})))
    diff = (got - run.logits).abs().max().item()
    assert diff <= 1e-6, f"EP1 logits differ from the TP2xEP2 original by {diff}"


W = "decoder.layers.mlp.linear_fc2.weight"  # stacked by layer


def _layer_cache(order, fail_at=None):
    import torch

    from checkpoints_tools.reshard import LayerCache

    loads = []

    def load(key, index):
        if (key, index) == fail_at:
            raise OSError(f"cannot read {key}")
        loads.append((key, index))
        return torch.full((2, 4), float(index[0]) if index else -1.0)

    return LayerCache(load, order=order), loads


def test_layer_cache_reads_ahead_each_layer_once_in_any_request_order():
    order = [(W, (0,)), (W, (1,)), (W, (2,)), ("embedding.word_embeddings.weight", ())]
    cache, loads = _layer_cache(order)
    for where in order:  # plan order, two TP halves each
        for half in (0, 2):
            chunk = cache.chunk(where[0], (*where[1], 0, half), (*([1] * len(where[1])), 2, 2))
            assert chunk.flatten().unique().tolist() == [float(where[1][0]) if where[1] else -1.0]
    assert loads == order
    cache.close()
    cache, loads = _layer_cache(order)
    got = [cache.chunk(W, (i, 0, 0), (1, 2, 4)).max().item() for i in (2, 0, 1)]  # out of order
    assert got == [2.0, 0.0, 1.0]
    cache.close()


def test_layer_cache_read_error_reaches_the_writer():
    cache, _ = _layer_cache([(W, (0,)), (W, (1,))], fail_at=(W, (1,)))
    cache.chunk(W, (0, 0, 0), (1, 2, 4))
    with pytest.raises(OSError, match="cannot read decoder"):
        cache.chunk(W, (1, 0, 0), (1, 2, 4))
    cache.close()
