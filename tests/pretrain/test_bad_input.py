"""Bad config, paths and data for `python -m pretrain`: every one is refused in validation,
before any process group exists (the helper makes init_process_group fail loudly), with
exit 2, one `error:` line naming the key or path, and nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.bad_input import expect_refusal

# A short run, so that a refusal that comes too late (after training) shows as such, not as a hang.
TINY = ["--recipe", "tiny-llama", "data.demo=false", "data.mock=true", "logging.tensorboard=false",
        "checkpoint.resume=none", "runtime.spec=portable", "schedule.train_steps=2", "schedule.micro_batch_size=2",
        "schedule.global_batch_size=4", "schedule.seq_length=64", "schedule.eval_interval=0"]


@pytest.fixture(scope="module")
def dataset(module_tmp_factory) -> Path:
    """A small real-text dataset tokenised with the demo SentencePiece model: (prefix, tokenizer)."""
    from data_pipeline.datasets import DEMO_CORPUS, DEMO_TOKENIZER
    from data_pipeline.preprocess import preprocess

    out = module_tmp_factory.mktemp("data")
    preprocess([DEMO_CORPUS], tokenizer=DEMO_TOKENIZER, output_prefix=str(out / "kjv"), append_eod=True, workers=0)
    return out / "kjv"


def _blend(prefix, weight: float = 1.0) -> list[str]:
    from data_pipeline.datasets import DEMO_TOKENIZER

    return ["data.mock=false", f"data.blend=[[{weight}, {prefix}]]", f"data.tokenizer={DEMO_TOKENIZER}"]


def _no_eod_tokenizer(tmp_path: Path) -> str:
    """A Hugging Face tokenizer.json with no end-of-document token (none of the EOS names)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate("in the beginning god created".split())}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "no-eod" / "tokenizer.json"
    path.parent.mkdir()
    tokenizer.save(str(path))
    return str(path)


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory\n")
    return path


# name -> (arguments after TINY given the case's tmp dir and dataset, fragments the error must name)
CASES = {
    "checkpoint.dir under a file": (lambda t, d: [f"checkpoint.dir={_file(t)}/ckpt", "--dry-run"],
                                    ["checkpoint.dir", "a-file"]),
    "checkpoint.dir under a file, training": (lambda t, d: [f"checkpoint.dir={_file(t)}/ckpt"],
                                              ["checkpoint.dir", "a-file"]),
    "checkpoint.dir not creatable (/sys)": (lambda t, d: ["checkpoint.dir=/sys/pretrain-ckpt"],
                                            ["checkpoint.dir", "/sys"]),
    "logging.run_dir under a file": (lambda t, d: [f"logging.run_dir={_file(t)}/run"], ["logging.run_dir", "a-file"]),
    "logging.run_dir not creatable (/sys)": (lambda t, d: ["logging.run_dir=/sys/pretrain-run", "--dry-run"],
                                             ["logging.run_dir", "/sys"]),
    "data.cache_dir under a file": (lambda t, d: [f"data.cache_dir={_file(t)}/cache"], ["data.cache_dir", "a-file"]),
    "blend prefix missing, dry run": (lambda t, d: [*_blend(t / "nope"), "--dry-run"], ["data.blend", "nope"]),
    "blend prefix missing, training": (lambda t, d: _blend(t / "nope"), ["data.blend", "nope"]),
    "blend weight negative": (lambda t, d: [*_blend(d, -1.0), "--dry-run"], ["data.blend", "-1"]),
    "blend weight zero": (lambda t, d: [*_blend(d, 0.0), "--dry-run"], ["data.blend", "0"]),
    "blend .bin truncated": (lambda t, d: [*_blend(_truncated(t, d)), "--dry-run"], ["cut", "truncated"]),
    "blend made with another tokenizer": (lambda t, d: ["data.mock=false", f"data.blend=[[1.0, {d}]]",
                                                         "data.tokenizer=byte", "--dry-run"],
                                          ["tokeni"]),
    "tokenizer file missing": (lambda t, d: ["data.mock=false", f"data.blend=[[1.0, {d}]]",
                                             f"data.tokenizer={t}/none.model", "--dry-run"], ["none.model"]),
    "data.split=abc": (lambda t, d: ["data.split=abc", "--dry-run"], ["data.split", "abc"]),
    "data.split=0,0,100": (lambda t, d: ["data.split=0,0,100", "--dry-run"], ["data.split", "train"]),
    "data.split with four parts": (lambda t, d: ["data.split=1,1,1,1", "--dry-run"], ["data.split"]),
    "data.split negative part": (lambda t, d: ["data.split=-1,1,0", "--dry-run"], ["data.split"]),
    "eval without a validation split": (lambda t, d: ["data.split=100,0,0", "schedule.eval_interval=10",
                                                      "--dry-run"], ["data.split", "eval_interval"]),
    "vocab smaller than the tokenizer's": (lambda t, d: ["data.mock=false", "data.demo=true",
                                                         "model.vocab_size=1000", "--dry-run"],
                                           ["model.vocab_size", "4000"]),
    "train_steps 1e12, mock data, dry run": (lambda t, d: ["schedule.train_steps=1000000000000", "--dry-run"],
                                             ["schedule.train_steps"]),
    "train_steps 1e12, mock data, training": (lambda t, d: ["schedule.train_steps=1000000000000"],
                                              ["schedule.train_steps"]),
    "train_steps 1e12, real data": (lambda t, d: [*_blend(d), "schedule.train_steps=1000000000000", "--dry-run"],
                                    ["schedule.train_steps", "kjv"]),
    "document masking, tokenizer without EOD": (lambda t, d: [f"data.tokenizer={_no_eod_tokenizer(t)}",
                                                              "data.reset_attention_mask=true"],
                                                 ["data.reset_attention_mask", "EOD", "tokenizer.json"]),
    "optimizer.lr=inf": (lambda t, d: ["optimizer.lr=inf", "--dry-run"], ["optimizer.lr"]),
    "optimizer.lr=nan": (lambda t, d: ["optimizer.lr=nan", "--dry-run"], ["optimizer.lr"]),
    "optimizer.lr negative": (lambda t, d: ["optimizer.lr=-1", "--dry-run"], ["optimizer.lr"]),
    "optimizer.min_lr above lr": (lambda t, d: ["optimizer.min_lr=1.0", "--dry-run"], ["optimizer.min_lr"]),
    "adam_eps=inf": (lambda t, d: ["optimizer.adam_eps=inf", "--dry-run"], ["optimizer.adam_eps"]),
    "decay_steps below warmup_steps": (lambda t, d: ["schedule.warmup_steps=10", "schedule.decay_steps=5",
                                                     "--dry-run"], ["schedule.decay_steps", "warmup_steps"]),
    "malformed YAML file": (lambda t, d: ["--config", _write(t / "bad.yaml", "schedule: {train_steps: 3\n"),
                                          "--dry-run"], ["bad.yaml", "YAML"]),
    "YAML file not a mapping": (lambda t, d: ["--config", _write(t / "list.yaml", "- 1\n- 2\n"), "--dry-run"],
                                ["list.yaml", "mapping"]),
    "YAML file missing": (lambda t, d: ["--config", str(t / "missing.yaml"), "--dry-run"], ["missing.yaml"]),
    "YAML file with an unknown key": (lambda t, d: ["--config", _write(t / "k.yaml", "schedul:\n  train_steps: 3\n"),
                                                    "--dry-run"], ["schedul", "schedule"]),
    "malformed YAML in an override": (lambda t, d: ["data.blend=[[1.0, x]", "--dry-run"], ["data.blend", "YAML"]),
    "override not key=value": (lambda t, d: ["train_steps", "--dry-run"], ["train_steps", "key=value"]),
    "unknown key": (lambda t, d: ["schedul.train_steps=3", "--dry-run"], ["schedul", "schedule"]),
    "value of the wrong type": (lambda t, d: ["schedule.train_steps=abc", "--dry-run"], ["schedule.train_steps"]),
    "unknown model flavor": (lambda t, d: ["model=llama9-1b", "--dry-run"], ["llama9-1b", "flavor"]),
    "--world-size 0": (lambda t, d: ["--dry-run", "--world-size", "0"], ["--world-size", "0"]),
    "--world-size -4": (lambda t, d: ["--dry-run", "--world-size", "-4"], ["--world-size", "-4"]),
    "layout does not fit the world": (lambda t, d: ["parallel.tensor_parallel=3", "--dry-run", "--world-size", "4"],
                                      ["TP", "3"]),
    "seq_length above max_seq_length": (lambda t, d: ["schedule.seq_length=100000", "--dry-run"],
                                        ["schedule.seq_length"]),
    "resume from a missing path": (lambda t, d: [f"checkpoint.resume={t}/no-ckpt"], ["no-ckpt"]),
}


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _truncated(tmp: Path, prefix: Path) -> Path:
    cut = tmp / "cut"
    shutil.copyfile(f"{prefix}.idx", f"{cut}.idx")
    data = Path(f"{prefix}.bin").read_bytes()
    Path(f"{cut}.bin").write_bytes(data[: len(data) // 2])
    return cut


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_any_process_group(case, tmp_path, dataset):
    build, names = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    args = build(tmp_path, dataset)  # inputs live beside `work`, where nothing may be written
    expect_refusal("pretrain", [*TINY, f"logging.run_dir={work}/run", *args] if not any(
        a.startswith("logging.run_dir=") for a in args) else [*TINY, *args], names=names, cwd=work, watch=tmp_path)


def test_recipe_unknown(tmp_path):
    expect_refusal("pretrain", ["--recipe", "tiny-lama", "--dry-run"], names=["tiny-lama", "tiny-llama"],
                   cwd=tmp_path)


@pytest.mark.parametrize("var", ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"])
def test_interface_override_naming_no_interface(var, tmp_path):
    """A multi-node knob set for another machine type: refused on any run, before the rendezvous
    (the loopback-hostname refusal needs a second node: tests/launch/test_multinode.py)."""
    expect_refusal("pretrain", [*TINY, f"logging.run_dir={tmp_path}/run"], names=[f"{var}=nosuchif0", "unset it"],
                   cwd=tmp_path, env={var: "nosuchif0"})
