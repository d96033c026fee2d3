"""Data pipeline: tokenizers, streaming preprocessing into Megatron-Core indexed
datasets, and blended training datasets.

Modules (each CLI is `python -m data_pipeline.<name>`, usage in its docstring):
- tokenizers: `load_tokenizer(spec)` for SentencePiece, HF tokenizer.json, tiktoken, byte
- train_tokenizer (CLI): train a SentencePiece BPE/unigram model
- preprocess (CLI): jsonl/jsonl.gz/parquet -> <prefix>.bin/.idx, streaming, atomic
- merge (CLI): join existing .bin/.idx pairs
- inspect (CLI): counts, length histogram, dtype, first documents decoded
- datasets: `build_gpt_datasets(...)`, `ensure_demo_dataset(out_dir)` for pretrain/
- debian_text (CLI): real English corpora from Debian packages
- benchmark (CLI): tokenizer vs preprocess throughput and peak memory

Importing the package imports nothing heavy: preprocessing workers import it.
"""
