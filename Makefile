PY ?= python3
.PHONY: setup demo test test-slow bench vllm
setup: .setup-done
.setup-done: pyproject.toml scripts/setup.sh
	PYTHON=$(PY) bash scripts/setup.sh
	touch .setup-done
demo: setup
	$(PY) -m hybridlm demo
test: setup
	$(PY) -m pytest
test-slow: setup
	$(PY) -m pytest -m slow
bench: setup
	$(PY) -m hybridlm bench --compare-hf
vllm:
	PYTHON=$(PY) bash scripts/setup-vllm.sh
