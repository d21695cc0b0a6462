"""Where one CPU decode step's time goes (bench/decode_profile.py, `hybridlm bench --suite decode-profile`), run from
this tree's file against whatever hybridlm is on PYTHONPATH: the same instrument on an older checkout and this one.

    PYTHONPATH=OLD/src python scripts/decode_profile.py --families llama --formats bf16,int8,int4
    PYTHONPATH=src     python scripts/decode_profile.py --quick --check
"""
import importlib.util
import os
import sys

import hybridlm.bench  # noqa: F401  (the package the profile module joins: its relative imports resolve there)

path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "hybridlm", "bench", "decode_profile.py")
spec = importlib.util.spec_from_file_location("hybridlm.bench.decode_profile", path)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
sys.exit(module.main())
