# Two entry points that work on a fresh machine (see README.md):
#   make demo   set up, fetch SmolLM2-135M, quantize it with RTN w4g128, print WikiText-2 PPL vs float
#   make test   set up, lint (ruff check) and run the test suite
# On CPU machines torch is installed first, pinned, so that no CUDA build is pulled in.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
export QUANTKIT_DATA ?= $(abspath ../shared/data)
DEMO_OUT ?= out/smollm2-rtn-w4g128
DEMO_WINDOWS ?= 20
BIN := $(VENV)/bin

.PHONY: setup demo lint test model clean

$(BIN)/quantkit: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(BIN)/quantkit

setup: $(BIN)/quantkit

model: setup
	$(BIN)/quantkit fetch-model

demo: model
	$(BIN)/quantkit quantize --model smollm2 --method rtn --bits 4 --group-size 128 --out $(DEMO_OUT) --overwrite
	$(BIN)/quantkit eval ppl --model smollm2 --model $(DEMO_OUT) --dataset wikitext2 \
		$(if $(DEMO_WINDOWS),--max-windows $(DEMO_WINDOWS)) --json out/demo-ppl.json

lint: setup
	$(BIN)/ruff check .

test: lint model
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) out .pytest_cache
