"""Process-level facts a command needs: how it was typed, the machine it ran on, and the allocator settings of a
command-line process.

Below every package (train, bench and the commands use it), so none of them imports `cli`.
"""
import ctypes
import os
import platform
import sys

# glibc mallopt parameters, and the values the command sets for its own process: freed blocks up to 1 GiB stay
# in the heap instead of going back to the OS, so a long-sequence step does not page-fault its activations
# in again every time (2x the cost per token past ~4K tokens on CPU; README, "The allocator")
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MALLOPT = ((_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, (1 << 31) - 1), (_M_TOP_PAD, 256 << 20))
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def tune_allocator() -> bool:
    """Raise glibc's mmap/trim thresholds and top pad for this process (a command-line entry point's choice;
    importing hybridlm changes nothing). Skipped where glibc is not the allocator, where jemalloc/tcmalloc is
    preloaded, or where the user set the MALLOC_* variables themselves. Returns whether it applied."""
    if platform.libc_ver()[0] != "glibc" or "malloc" in os.environ.get("LD_PRELOAD", "") or \
            any(v in os.environ for v in _ENV):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in _MALLOPT)


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
