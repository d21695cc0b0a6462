"""Process-level facts a command needs: how it was typed, the machine it ran on, and the allocator policy of a
command-line process.

Below every package (train, bench and the commands use it), so none of them imports `cli`.
"""
import ctypes
import os
import platform
import sys

# The allocator policy of a command-line process (README, "The allocator"; importing hybridlm changes nothing).
# glibc mallopt parameters, and the values of each policy:
#   keep     freed blocks up to 1 GiB stay in the heap, so a step that frees and reallocates the same activations
#            does not page-fault them in again: 2x the cost per token past ~4K tokens on CPU otherwise. Right for one
#            process, DDP and context parallelism, whose steps allocate the same sizes in the same order.
#   release  glibc's own starting thresholds, held fixed: blocks from 128 KiB are mapped and unmapped, free heap
#            top above 128 KiB is trimmed. For FSDP2: each block's parameters and gradients are gathered and freed
#            between the sharded gradients it keeps, and in a heap that keeps everything the holes they leave are
#            too small for the next gather, so the heap grows by ~0.3 GB a step (100M: 2.45 GB peak per rank, 1.44
#            with release; 1.9 with glibc's dynamic ceiling of 32 MiB, which a parameter of 28 MB stays under;
#            docs/memory.md).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
POLICIES = {
    "keep": ((_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, (1 << 31) - 1), (_M_TOP_PAD, 256 << 20)),
    "release": ((_M_MMAP_THRESHOLD, 128 << 10), (_M_TRIM_THRESHOLD, 128 << 10), (_M_TOP_PAD, 128 << 10)),
}
_ABOUT = {"keep": "freed blocks up to 1 GiB stay in the heap (mmap threshold 1 GiB, trim threshold 2 GiB, top pad "
                  "256 MiB)",
          "release": "blocks from 128 KiB go back to the OS when freed (mmap and trim thresholds 128 KiB, fixed)"}
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_in_force = None   # what set_allocator last found or did, for run headers


def allocator_policy(parallel: str | None = None, world: int | None = None) -> str:
    """The policy for a run: release under FSDP on several ranks, keep otherwise (see above). `world` defaults to
    torchrun's WORLD_SIZE."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    return "release" if parallel == "fsdp" and world > 1 else "keep"


def _preloaded() -> str | None:
    """jemalloc or tcmalloc when one replaces malloc in this process (LD_PRELOAD), else None."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        maps = os.environ.get("LD_PRELOAD", "")
    return next((name for name in ("jemalloc", "tcmalloc") if name in maps), None)


def set_allocator(policy: str = "keep") -> str:
    """Apply an allocator policy ("keep" | "release", see above) to this process through glibc's mallopt; returns
    the one-line description of what is in force. Left alone where glibc is not the allocator, where jemalloc or
    tcmalloc is preloaded, or where the user set the MALLOC_* variables themselves."""
    global _in_force
    if policy not in POLICIES:
        raise ValueError(f"allocator policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    user = [f"{v}={os.environ[v]}" for v in _ENV if v in os.environ]
    if platform.libc_ver()[0] != "glibc":
        _in_force = "the platform's allocator, unchanged (not glibc)"
    elif (lib := _preloaded()):
        _in_force = f"{lib} (preloaded), unchanged"
    elif user:
        _in_force = f"glibc, from the environment ({' '.join(user)})"
    else:
        try:
            libc = ctypes.CDLL("libc.so.6")
            ok = all(libc.mallopt(param, value) == 1 for param, value in POLICIES[policy])
        except OSError:
            ok = False
        _in_force = f"glibc {policy}: {_ABOUT[policy]}" if ok else "glibc, unchanged (mallopt refused)"
    return _in_force


def allocator_in_force() -> str:
    """What the last set_allocator found or did; glibc's defaults when nothing set it."""
    return _in_force or "the default (no policy applied; hybridlm.runtime.set_allocator)"


def tune_allocator() -> bool:
    """set_allocator("keep"), the policy of a single process (a command-line entry point's choice): whether
    it applied."""
    return set_allocator("keep").startswith("glibc keep")


def command_line() -> str:
    """This process's command as a user would type it ("hybridlm bench ..."), never a path of the machine."""
    import shlex
    prog = os.path.basename(sys.argv[0])
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    return f"hybridlm {args}" if prog in ("hybridlm", "__main__.py") else f"python {prog} {args}".rstrip()


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): above the core count, processes shared cores."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def cpu_model() -> str:
    """The CPU's model name as lscpu shows it (/proc/cpuinfo; the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def machine_meta(threads: int | None = None) -> dict:
    """What a result file records of its run: time, command, versions, the machine, torch threads per process
    (`threads`, default this process's) and the load average at writing time, which says whether the machine was
    quiet (load <= cores: every process had a core) or shared."""
    import datetime

    import torch

    from . import __version__
    return {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command_line(), "python": platform.python_version(), "torch": torch.__version__,
            "hybridlm": __version__, "machine": platform.machine(), "processor": platform.processor(),
            "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count(), "threads": threads or torch.get_num_threads(),
            "load_avg": load_average(),
            "device": "cuda" if torch.cuda.is_available() else "cpu"}
