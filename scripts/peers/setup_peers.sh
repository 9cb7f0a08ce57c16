#!/usr/bin/env bash
# The two peers of scripts/bench_peers.py, each at a pinned commit of its own repository, in its own virtual
# environment with the library versions it asks for, installed from the package index (docs/peers.md).
#
#   bash scripts/peers/setup_peers.sh OPENFEDLLM_GIT FLOWER_GIT OUT
#
# OPENFEDLLM_GIT, FLOWER_GIT: clones (or bare git dirs) of rui-ye/OpenFedLLM and flwrlabs/flower; OUT: where
# the checkouts and venvs go (outside this repository: none of their code is committed here). Writes
#   OUT/openfedllm/          OpenFedLLM at 14c6af2 (main_sft.py and its packages, unchanged)
#   OUT/flowertune-app/      the app Flower's `flwr new --framework flowertune` generated at 7325669 (the
#                            FlowerTune LLM leaderboard's template: trl's SFTTrainer per client on the
#                            Simulation Engine), rendered for the general-NLP challenge, unchanged
#   OUT/ofl-venv, OUT/ft-venv   their environments; OUT/*-freeze.txt what got installed
# Python 3.11 (OpenFedLLM's README names 3.10; its pins install on 3.11 too). The pins are each repository's own
# (OpenFedLLM: requirements.txt, the libraries main_sft.py imports; the template: its pyproject's
# dependencies); torch comes from the index (CUDA builds, which run on a CPU).
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 OPENFEDLLM_GIT FLOWER_GIT OUT" >&2; exit 2; }
git_dir() { (cd "$1" && cd "$(git rev-parse --git-dir)" && pwd); }  # a clone's .git, or a bare repository
ofl_git=$(git_dir "$1"); flower_git=$(git_dir "$2"); out=$(mkdir -p "$3" && cd "$3" && pwd)
OFL_COMMIT=14c6af2dd5c830e8b22a48b263ae33afdd285fc8
FLOWER_COMMIT=7325669f45db9397d8993beddcb08325a08caa3b

rm -rf "$out/openfedllm" && mkdir -p "$out/openfedllm"
git --git-dir="$ofl_git" archive "$OFL_COMMIT" | tar -x -C "$out/openfedllm"
python3.11 - "$flower_git" "$FLOWER_COMMIT" "$out/flowertune-app" <<'PY'
import pathlib, string, subprocess, sys
git, commit, out = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
base = "framework/py/flwr/cli/new/templates/app"
values = {  # what `flwr new` fills in for the general-NLP challenge (its own table, at that commit)
    "project_name": "flowertune", "package_name": "flowertune", "import_name": "flowertune",
    "username": "fedllm-bench", "llm_challenge_str": "generalnlp", "fraction_train": "0.1",
    "dataset_name": "flwrlabs/alpaca-gpt4", "num_clients": "20",
}
def show(path):
    return subprocess.run(["git", f"--git-dir={git}", "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout
(out / "flowertune").mkdir(parents=True, exist_ok=True)
(out / "pyproject.toml").write_text(string.Template(show(f"{base}/pyproject.flowertune.toml.tpl")).safe_substitute(values))
(out / "flowertune" / "__init__.py").write_text('"""flowertune: A Flower / FlowerTune app."""\n')
for name in ("client_app", "dataset", "models", "server_app", "strategy"):
    text = show(f"{base}/code/flwr_tune/{name}.py.tpl")
    (out / "flowertune" / f"{name}.py").write_text(string.Template(text).safe_substitute(values))
PY
cd "$out"
python3.11 -m venv ofl-venv
ofl-venv/bin/pip install -q --upgrade pip
ofl-venv/bin/pip install -q torch==2.0.1 transformers==4.31.0 peft==0.4.0 trl==0.7.2 datasets==2.13.0 \
  accelerate==0.21.0 tokenizers==0.13.3 sentencepiece==0.1.99 numpy==1.25.2 safetensors==0.3.3 \
  huggingface-hub==0.16.4 fsspec==2023.6.0 pyarrow==13.0.0 pandas==2.1.0 psutil==5.9.5 tyro==0.5.10 \
  scipy==1.11.2
ofl-venv/bin/pip freeze > ofl-freeze.txt
python3.11 -m venv ft-venv
ft-venv/bin/pip install -q --upgrade pip
ft-venv/bin/pip install -q "flwr[simulation]>=1.25.0" "flwr-datasets>=0.5.0" torch==2.4.0 trl==0.8.1 \
  bitsandbytes==0.45.4 scipy==1.13.0 peft==0.6.2 transformers==4.50.3 sentencepiece==0.2.0 omegaconf==2.3.0 \
  hf_transfer==0.1.8 psutil
ft-venv/bin/pip freeze > ft-freeze.txt
echo "peers ready in $out"
