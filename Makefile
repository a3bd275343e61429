# The two set-up commands of the README: `make quickstart` and `make test`. Both create the venv if needed.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0: a CPU wheel on the project's CPU machines, the CUDA build from PyPI on a GPU box.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# speculators (the peer DSpark trainer; tests/test_speculators_*.py, bench/peer_speculators.py) is installed without its
# dependencies: they pull torchvision, whose PyPI build is CUDA-only and breaks transformers' imports beside a CPU
# torch. What it needs beyond ours (loguru, pydantic-settings) is in the dev extra.
PEER_SPEC ?= speculators==0.9.0 hs-connectors==0.9.0

.PHONY: quickstart quickstart-ablation test install data-sources lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)" || $(BIN)/python -m pip install -q "torch>=2.6"
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps $(PEER_SPEC)
	touch $@

install: $(STAMP)

data-sources: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/install-data-sources.sh

QS := runs/quickstart
quickstart: data-sources
	$(BIN)/python -m train recipes/targets/qwen3-tiny.yaml output_dir=$(QS)/target overwrite=true
	$(BIN)/python -m train recipes/quickstart.yaml target=$(QS)/target/final output_dir=$(QS)/drafter overwrite=true
	$(BIN)/python -m eval --target $(QS)/target/final --drafter $(QS)/drafter/final --name dspark \
		--corpus .cache/corpus-stdlib --tasks code_holdout,humaneval,creative,chat \
		--num-prompts 20 --max-tokens 64 --threads 2 --out $(QS)/eval

# DSpark vs the dflash layout (as many drafts a step: block 9), trained with the same data and steps (after
# `make quickstart`)
quickstart-ablation: data-sources
	$(BIN)/python -m train recipes/quickstart.yaml target=$(QS)/target/final output_dir=$(QS)/dflash overwrite=true \
		drafter.mode=dflash drafter.block_size=9 drafter.markov_rank=0
	$(BIN)/python -m eval --target $(QS)/target/final --drafter $(QS)/drafter/final --name dspark \
		--drafter $(QS)/dflash/final --name dflash --corpus .cache/corpus-stdlib \
		--tasks code_holdout,humaneval,creative,chat --num-prompts 20 --max-tokens 64 --threads 2 \
		--out $(QS)/eval-ablation

test: data-sources
	$(BIN)/python -m pytest tests

lint: $(STAMP)
	$(BIN)/ruff check dspark train serve eval tests bench

clean:
	rm -rf $(VENV) .cache runs
