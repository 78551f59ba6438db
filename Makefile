# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
#
# Three virtual environments, because the frameworks pin numpy differently:
#   .venv     dmdask + PyTorch + JAX (CPU builds)   the main suite (tests/), with the formats and jobqueue extras
#   .venv-tf  dmdask + TensorFlow (tensorflow-cpu)  tests/test_tensorflow.py
#   .venv-mx  dmdask + MXNet 1.9.1 + numpy 1.26.4   tests/test_mxnet.py
#   .venv-peers  dmdask + the loaders it is compared with (Mosaic streaming, LitData, Grain,
#             WebDataset) + moto's S3 server        `make bench-peers` (not part of `make test`)
# Each is built once (its stamp file .installed) and rebuilt when pyproject.toml changes.
PYTHON    ?= python3
# MXNet 1.9.1 needs numpy < 2; numpy 1.26.4 has wheels up to Python 3.12
PYTHON_MX ?= python3.11
VENV      ?= .venv
VENV_TF   ?= .venv-tf
VENV_MX   ?= .venv-mx
VENV_PEERS ?= .venv-peers
BIN       := $(VENV)/bin
TF_BIN    := $(VENV_TF)/bin
MX_BIN    := $(VENV_MX)/bin
PEERS_BIN := $(VENV_PEERS)/bin

.PHONY: demo test test-main test-tf test-mx bench-peers bench-peers-full clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	# The pinned CPU builds first, so the extras' ranges install nothing more.
	$(BIN)/python -m pip install torch==2.13.0 jax==0.10.2 jaxlib==0.10.2
	$(BIN)/python -m pip install -e ".[torch,jax,dashboard,images,demo,formats,jobqueue,readers,test]"
	touch $@

$(TF_BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_TF)
	$(TF_BIN)/python -m pip install --upgrade pip
	# tensorflow-cpu is another distribution than the extra's `tensorflow`: install it
	# and dmdask without that extra.
	$(TF_BIN)/python -m pip install tensorflow-cpu==2.21.0 -e ".[test]"
	touch $@

$(MX_BIN)/.installed: pyproject.toml
	$(PYTHON_MX) -m venv $(VENV_MX)
	$(MX_BIN)/python -m pip install --upgrade pip
	# one resolve with numpy pinned, so nothing upgrades it past MXNet's numpy < 2
	$(MX_BIN)/python -m pip install numpy==1.26.4 mxnet==1.9.1 -e ".[mxnet,test]"
	touch $@

$(PEERS_BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_PEERS)
	$(PEERS_BIN)/python -m pip install --upgrade pip
	# torch's CPU build first, then one resolve with it pinned, so that the peers' torchvision
	# resolves to its match and nothing replaces it (mosaicml-streaming's numpy < 2.2 stays here)
	$(PEERS_BIN)/python -m pip install torch==2.13.0
	$(PEERS_BIN)/python -m pip install torch==2.13.0 -e ".[peers]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/dmdask demo

# All three suites run even when one fails; any failure fails `make test`. In its own
# environment a framework's test module fails, not skips, when the framework is missing.
test: $(BIN)/.installed $(TF_BIN)/.installed $(MX_BIN)/.installed
	@status=0; \
	$(MAKE) --no-print-directory test-main || status=1; \
	$(MAKE) --no-print-directory test-tf || status=1; \
	$(MAKE) --no-print-directory test-mx || status=1; \
	exit $$status

# The dashboard test drives Debian's Chromium, the mount test libfuse (Debian's fuse3), the
# Slurm tests Debian's slurm-wlm and munge (tests/test_slurm.py starts and stops them itself);
# the scripts install them when missing.
test-main: $(BIN)/.installed
	bash scripts/install-browser.sh
	bash scripts/install-fuse.sh
	bash scripts/install-slurm.sh
	$(BIN)/python -m compileall -q dmdask  # once: every worker process the tests start imports it
	$(BIN)/python -m pytest

test-tf: $(TF_BIN)/.installed
	DMDASK_REQUIRE_FRAMEWORK=tensorflow $(TF_BIN)/python -m pytest tests/test_tensorflow.py

test-mx: $(MX_BIN)/.installed
	DMDASK_REQUIRE_FRAMEWORK=mxnet $(MX_BIN)/python -m pytest tests/test_mxnet.py

# dmdask beside the loaders users pick today (docs/benchmarks.md, section 8); quick: < 15 minutes
bench-peers: $(PEERS_BIN)/.installed
	$(PEERS_BIN)/python -m benchmarks run --peers --quick

bench-peers-full: $(PEERS_BIN)/.installed
	$(PEERS_BIN)/python -m benchmarks run --peers --full

clean:
	rm -rf $(VENV) $(VENV_TF) $(VENV_MX) $(VENV_PEERS) .pytest_cache demo-data
