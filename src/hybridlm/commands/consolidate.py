"""`hybridlm consolidate`: write model.safetensors from the DCP shards of an FSDP checkpoint, in one process."""
from .common import out


def main(args) -> int:
    from ..checkpoint.dcp import consolidate
    out(f"wrote {consolidate(args.checkpoint)}")
    return 0


def add_arguments(p):
    p.add_argument("checkpoint", help="checkpoint directory (or run directory) saved with --parallel fsdp")
