"""Every change this project makes to Megatron-Core's behaviour (and to the torch functions
it calls), in one package, applied by one call.

    from pretrain import megatron_fixes
    megatron_fixes.apply()          # at start-up: pretrain.runtime.init_distributed does it

Each module holds fixes of one kind. For every fix its docstring says what it changes, why
(the upstream line or behaviour), the Megatron-Core versions it is known for, and it checks a
guard (`_guard.expect_source`: a digest of the patched upstream source) that fails loudly at
start-up when upstream has changed the patched object:

- `cpu`: stand-ins for CUDA APIs so the real code paths run on CPU through gloo (only when
  CUDA is absent).
- `optimizer`: the distributed optimizer's checkpoint paths with torch's AdamW (no TE/Apex):
  loading a never-stepped optimizer, a `step` key missing from shards, a shared `step`
  tensor after loading; and its fully-reshardable save state built without Megatron's
  triple copy (`optimizer_save`).
- `dist_checkpointing`: dist_checkpointing's save planner hands tensors through a hook (async
  staging, no clones for sync saves); write results reported in-process (no Manager process
  per rank); safe loading (no code runs from a checkpoint); shards hashed as they are written.
- `fsdp`: Megatron-FSDP (ZeRO-2/3, HSDP) on CPU, and the (0.16.1) bugs its layouts avoid.
- `import_cost`: the torch.compile wrappers megatron.core builds as it is imported (2.8 CPU-s
  per process) deferred to each function's first call; installed when `pretrain` is imported
  (it must precede megatron.core's import), its guard checked here.
- `quiet`: log lines about choices we made on purpose (the CUDA build of torch without a GPU,
  GPTModel's deprecation, DDP's self-computed ZeRO-1 layout, Megatron's own async save),
  filtered by their exact text.
- `muon`: Megatron-Core's Muon leaves the MoE router to AdamW too (its registry's default
  per-parameter override, which callers cannot extend).
- `lion`: optimizer="lion" is Lion on every parameter with lion_beta1/lion_beta2 (upstream's
  registry entry put non-matrices on Adam and passed Adam's betas).
- `mtp`: multi-token prediction's loss mask, one per depth (document masking with two or more
  MTP layers; upstream rolls one mask for every depth).
- `datasets`: the GPT dataset's cached loss mask, which kept the pad positions of the first
  sample a process served (so the loss depended on the DP layout with mock data).

Deleted with Megatron-Core 0.19.2: `no_te` (0.16.1's MoE router hit a NameError without
Transformer Engine, `te_general_gemm` undefined; 0.19's moe_utils.py defines it as None when TE
is absent), and the fsdp stand-in for `TELinear` (fsdp.py says why).

Not here, because it is per model rather than per process: `models/rope.py` completes
Megatron-Core's Llama-3.1 RoPE scaling (GPTModel passes only the factor) with the model's
low/high frequency factors and original context, called by models.build for every built
model (models/ cannot import pretrain), with its own guard.

`python -m pretrain.megatron_fixes --digests` prints the digest of every guarded object
(to re-pin a fix after reading a new upstream version).
"""

from __future__ import annotations

import warnings

from pretrain.megatron_fixes._guard import UpstreamChanged  # noqa: F401 (re-exported: callers catch it)

_APPLIED: set[str] = set()


def quiet_cpu_fallback_warnings() -> None:
    """Importing megatron.core without Transformer Engine/Apex warns four times that it falls
    back to torch implementations ("Transformer Engine and Apex are not installed"). On a
    machine without CUDA that is the only possible setup, so every CLI printed noise. With
    CUDA the warnings stay: there a missing TE costs speed (and `runtime.spec=te` refuses to
    start without it, in models.build.resolve_spec)."""
    import torch

    if not torch.cuda.is_available():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine and Apex are|Apex is) not installed",
                                category=UserWarning)


def apply(*, cpu: bool | None = None) -> None:
    """Apply every fix this machine needs (idempotent). `cpu=None`: the CUDA stand-ins iff
    CUDA is absent. Call before building models or optimizers."""
    import torch

    from pretrain.megatron_fixes import datasets, dist_checkpointing, import_cost, lion, mtp, muon, optimizer, quiet

    if cpu is None:
        cpu = not torch.cuda.is_available()
    quiet_cpu_fallback_warnings()
    fixes = [("optimizer", optimizer.apply), ("dist_checkpointing", dist_checkpointing.apply),
             ("import_cost", import_cost.apply), ("datasets", datasets.apply), ("quiet", quiet.apply),
             ("muon", muon.apply), ("lion", lion.apply), ("mtp", mtp.apply)]
    if cpu:
        from pretrain.megatron_fixes import cpu as cpu_fixes, fsdp

        fixes[:0] = [("cpu", cpu_fixes.apply), ("fsdp", fsdp.apply)]
    for name, fix in fixes:
        if name not in _APPLIED:
            fix()
            _APPLIED.add(name)


def modules() -> tuple:
    """Every fix module, each with its `SOURCES` (the pinned upstream objects and digests)."""
    from pretrain.megatron_fixes import cpu, datasets, dist_checkpointing, fsdp, import_cost, lion, mtp, muon, optimizer

    return (cpu, fsdp, optimizer, dist_checkpointing, import_cost, datasets, muon, lion, mtp)


def applied() -> frozenset[str]:
    return frozenset(_APPLIED)
