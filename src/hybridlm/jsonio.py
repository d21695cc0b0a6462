"""Reading the small JSON files hybridlm keeps beside weights and tokens (configs, sidecars, manifests)."""
import json

from .errors import HybridLMError, InputError


def read_json_object(path: str, error: type[HybridLMError] = InputError) -> dict:
    """A JSON file holding an object, or one `error` naming the file: missing, unreadable, not JSON, not an object."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise error(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise error(f"{path} should hold a JSON object")
    return obj


def parse_sets(items: list[str]) -> dict:
    """["layout=(AM)*2", "n_heads=4"] -> {"layout": "(AM)*2", "n_heads": 4} (values JSON-parsed if possible)."""
    out = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise InputError(f"--set expects field=value, got {item!r}")
        try:
            out[key.strip().replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip().replace("-", "_")] = value
    return out
