"""Serving: an engine (model + cache slots + prefix cache), a continuous-batching scheduler and an OpenAI-compatible
HTTP API, in that order of layering (vLLM's): `engine` and `scheduler` are plain Python and usable without HTTP;
`api` only parses, validates, streams and reports."""
from .engine import Engine, Request, SamplingParams
from .scheduler import QueueFull, Scheduler

__all__ = ["Engine", "Request", "SamplingParams", "Scheduler", "QueueFull"]
