"""Train a SentencePiece tokenizer (BPE or unigram) from text, jsonl or parquet files.

    python -m data_pipeline.train_tokenizer \\
        --input data_pipeline/assets/kjv.jsonl.gz --model-prefix /tmp/kjv_sp \\
        --vocab-size 4000 --model-type bpe --byte-fallback --pad

writes /tmp/kjv_sp.model and /tmp/kjv_sp.vocab (atomically). Inputs: .txt/.txt.gz
(one sentence per line) or .jsonl/.jsonl.gz/.parquet (documents in --text-field,
split into lines). Special ids follow Llama: <unk>=0, <s>=1, </s>=2, then <pad>=3
with --pad, then --user-defined-symbols. Text is not normalised and whitespace is
kept (as Llama's tokenizer), so decode(encode(text)) == text.

Memory: at most --input-sentence-size sentences (default 2M, sampled uniformly
from all input) are held for training.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Iterator

from data_pipeline.sources import (
    BadRecord,
    InputError,
    InputFile,
    check_readable,
    iter_chunks,
    iter_records,
    open_maybe_gzip,
    resolve_inputs,
)


class _Reader:
    """Yields training sentences and counts what it read, for the progress display."""

    def __init__(self, sources: list[InputFile], text_field: str) -> None:
        self.sources = sources
        self.text_field = text_field
        self.disk_bytes = 0
        self.sentences = 0
        self.bad_records = 0

    def __iter__(self) -> Iterator[str]:
        for source in self.sources:
            if source.kind == "text":
                with open_maybe_gzip(source.path) as f:
                    for raw in f:
                        self.disk_bytes += len(raw)  # uncompressed; close enough for .gz
                        yield from self._lines(raw.decode("utf-8", errors="replace"))
                continue
            for chunk in iter_chunks([source], 1 << 20, self.text_field):
                for _, text in iter_records(chunk, self.text_field):
                    if isinstance(text, BadRecord):
                        self.bad_records += 1
                        continue
                    yield from self._lines(text)
                self.disk_bytes += chunk.disk_bytes

    def _lines(self, text: str) -> Iterator[str]:
        for line in text.splitlines():
            if line.strip():
                self.sentences += 1
                yield line


class TrainingError(RuntimeError):
    """SentencePiece refused the corpus or the options (e.g. a vocabulary larger than the
    text supports); the message is its own."""


def train(inputs: list[str], model_prefix: str, *, vocab_size: int, model_type: str = "bpe",
          byte_fallback: bool = False, pad: bool = False, user_defined_symbols: list[str] = (),
          text_field: str = "text", input_sentence_size: int = 2_000_000,
          character_coverage: float = 0.9995, num_threads: int | None = None,
          progress: bool = True, verbose: bool = False, overwrite: bool = False) -> str:
    """Train and write `<model_prefix>.model` / `.vocab`; returns the .model path. An
    existing model there is replaced only with `overwrite` (datasets made with it would no
    longer match their tokenizer)."""
    import sentencepiece as spm
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    directory = os.path.dirname(os.path.abspath(model_prefix))
    if not os.path.isdir(directory):
        raise InputError(f"output directory {directory!r} does not exist; create it first")
    if not overwrite and any(os.path.exists(model_prefix + ext) for ext in (".model", ".vocab")):
        raise InputError(f"{model_prefix}.model/.vocab already exist; pass --overwrite to replace them (datasets "
                         "tokenised with the old model will no longer match it) or choose another --model-prefix")
    sources = resolve_inputs(inputs, allow_text=True)
    for source in sources:
        if source.kind != "text":
            check_readable(source, text_field)
    reader = _Reader(sources, text_field)
    tmp_prefix = model_prefix + ".partial"
    options = dict(
        sentence_iterator=iter(reader), model_prefix=tmp_prefix, vocab_size=vocab_size,
        model_type=model_type, byte_fallback=byte_fallback,
        user_defined_symbols=list(user_defined_symbols), character_coverage=character_coverage,
        input_sentence_size=input_sentence_size, shuffle_input_sentence=True,
        num_threads=num_threads or os.cpu_count() or 1,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3 if pad else -1,
        # Llama's choices: the text is kept exactly, digits are split one by one.
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True,
        max_sentence_length=1 << 16, minloglevel=0 if verbose else 2,
    )
    total = sum(s.size for s in sources)
    console = Console(stderr=True)
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               TextColumn("{task.fields[sentences]:,} sentences"), TimeElapsedColumn()]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            spm.SentencePieceTrainer.train(**options)
        except BaseException as err:  # re-raised in the caller's thread
            errors.append(err)

    # SentencePiece trains in C++ without callbacks: run it in a thread and show the
    # reading progress (our iterator) and then the training phase by elapsed time.
    worker = threading.Thread(target=run, daemon=True)
    with Progress(*columns, console=console, disable=not progress) as bar:
        task = bar.add_task(f"reading {len(sources)} file(s)", total=total, sentences=0)
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
            bar.update(task, completed=min(reader.disk_bytes, total), sentences=reader.sentences)
            if reader.disk_bytes >= total:
                bar.update(task, description=f"training {model_type} ({vocab_size} pieces)")
    try:
        if errors:
            raise TrainingError(f"sentencepiece training failed: {errors[0]}") from errors[0]
        for ext in (".model", ".vocab"):
            os.replace(tmp_prefix + ext, model_prefix + ext)
    finally:
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + ext):
                os.unlink(tmp_prefix + ext)
    if reader.bad_records:
        console.print(f"[yellow]skipped {reader.bad_records:,} bad records")
    return model_prefix + ".model"


def main(argv: list[str] | None = None) -> int:
    from data_pipeline.checks import fraction, positive_int, run_cli

    parser = argparse.ArgumentParser(prog="python -m data_pipeline.train_tokenizer",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", "-i", nargs="+", required=True, help="files or globs")
    parser.add_argument("--model-prefix", "-o", required=True, help="writes PREFIX.model/.vocab")
    parser.add_argument("--vocab-size", type=positive_int, required=True)
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--byte-fallback", action="store_true",
                        help="unknown characters become UTF-8 byte pieces instead of <unk>")
    parser.add_argument("--pad", action="store_true", help="reserve <pad> as id 3")
    parser.add_argument("--user-defined-symbols", nargs="*", default=[], metavar="TOKEN",
                        help="special tokens always kept whole, e.g. '<|im_start|>'")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--input-sentence-size", type=positive_int, default=2_000_000)
    parser.add_argument("--character-coverage", type=fraction, default=0.9995)
    parser.add_argument("--num-threads", type=positive_int, default=None)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.model/.vocab")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="show sentencepiece's own log")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def body() -> int:
        path = train(args.input, args.model_prefix, vocab_size=args.vocab_size,
                     model_type=args.model_type, byte_fallback=args.byte_fallback, pad=args.pad,
                     user_defined_symbols=args.user_defined_symbols, text_field=args.text_field,
                     input_sentence_size=args.input_sentence_size,
                     character_coverage=args.character_coverage, num_threads=args.num_threads,
                     progress=not args.no_progress, verbose=args.verbose, overwrite=args.overwrite)
        print(f"wrote {path} in {time.perf_counter() - started:.1f} s")
        return 0

    return run_cli(body, bad_input=(InputError, TrainingError))


if __name__ == "__main__":
    sys.exit(main())
