#!/usr/bin/env bash
# One entry point for the README's quick start.
#   bash dev.sh demo   -> set up .venv, then train tiny-llama on CPU (TP2 x PP2, 4 gloo ranks)
#   bash dev.sh test   -> set up .venv, then run the test suite
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        python3 -m venv "$VENV"
    fi
    local py="$VENV/bin/python"
    # Install the CPU torch first and on its own: every later requirement is
    # satisfied by it, so pip never reaches for a multi-GB CUDA build.
    "$py" -m pip install -q --upgrade pip
    "$py" -m pip install -q torch==2.13.0
    # The tracker extras too: the tests read MLflow and W&B records back with the real libraries.
    "$py" -m pip install -q -e ".[test,mlflow,wandb]"
    # Test-only: real pretrained tokenizer files (Mistral 32k SentencePiece, Llama-3 128k
    # tiktoken). --no-deps: mistral-common pins numpy<2.4, and only its data files are read.
    "$py" -m pip install -q --no-deps mistral-common==1.13.1 llama-models==0.3.0
}

case "${1:-}" in
    demo)
        setup
        shift
        exec "$VENV/bin/python" -m launch.local --recipe tiny-llama --nproc 4 \
            parallel.tensor_parallel=2 parallel.pipeline_parallel=2 "$@"
        ;;
    test)
        setup
        shift
        # setup installed the real tokenizers; their absence (or Debian text's) is a failure.
        export PRETRAIN_REQUIRE_REAL_TEXT=${PRETRAIN_REQUIRE_REAL_TEXT:-1}
        exec "$VENV/bin/python" -m pytest -q "$@"
        ;;
    *)
        echo "usage: bash dev.sh demo|test [extra args]" >&2
        exit 2
        ;;
esac
