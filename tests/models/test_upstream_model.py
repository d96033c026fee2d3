"""We build on Megatron-Core's GPTModel, which 0.19 deprecates in favour of HybridModel (README,
"GPTModel or HybridModel"). These tests fail the day upstream removes or reshapes what we use,
so the migration is planned then, not discovered in a user's run."""

from __future__ import annotations

import inspect

from megatron.core.models.gpt import GPTModel

import models.build
from models.documents import DocumentGPTModel

# Every GPTModel constructor argument models.build passes.
_CONSTRUCTOR = ("config", "transformer_layer_spec", "vocab_size", "max_sequence_length", "pre_process",
                "post_process", "share_embeddings_and_output_weights", "position_embedding_type",
                "rotary_base", "rope_scaling", "rope_scaling_factor", "vp_stage")


def test_gpt_model_still_takes_what_models_build_passes():
    parameters = inspect.signature(GPTModel.__init__).parameters
    missing = [name for name in _CONSTRUCTOR if name not in parameters]
    assert not missing, f"GPTModel.__init__ no longer takes {missing}: time to move to HybridModel (README)"
    source = inspect.getsource(models.build.build_model_chunks)
    assert all(f"{name}=" in source for name in _CONSTRUCTOR if name != "config") and "config=config" in source


def test_gpt_model_still_has_the_hooks_document_masking_overrides():
    """DocumentGPTModel overrides `_preprocess` (RoPE at the batch's positions) and calls
    `forward` with packed sequence parameters; both must still be GPTModel's."""
    assert issubclass(DocumentGPTModel, GPTModel)
    preprocess = inspect.signature(GPTModel._preprocess).parameters
    assert list(preprocess)[:3] == ["self", "input_ids", "position_ids"], list(preprocess)
    assert "packed_seq_params" in inspect.signature(GPTModel.forward).parameters


def test_gpt_model_is_deprecated_but_not_removed():
    """0.19.2 logs a deprecation (filtered by megatron_fixes.quiet) and names no removal
    version; if upstream starts raising, or announces the removal, this fails."""
    source = inspect.getsource(GPTModel.__init__)
    assert "GPTModel IS DEPRECATED" in source
    assert "raise" not in source.split("GPTModel IS DEPRECATED")[0].rsplit("log_single_rank", 1)[-1]
    assert "removal" not in source.lower()
