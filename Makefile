# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	# The pinned CPU build first, so the extra's range installs nothing more.
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e ".[torch,dashboard,test]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/dmdask demo

test: $(BIN)/.installed
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache demo-data
