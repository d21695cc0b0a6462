"""Helpers of the serve tests: tiny models and a live server on a free loopback port in this process."""
import socket
import threading
import time
from contextlib import contextmanager

import torch

from hybridlm import presets
from hybridlm.data.tokenizer import ByteTokenizer

TINY = dict(d_model=32, n_heads=4, vocab_size=257, ssd_headdim=8, ssd_d_state=8, ssd_chunk_size=8, max_seq_len=128,
            rodimus_d_state=8, swa_window=8, mlp_hidden=None, mamba1_d_state=4)
FAMILIES = ["transformer++", "mamba2", "rodimus++", "mamba2-attention"]


def tiny(name: str, n_layers: int = 2, **kw):
    from hybridlm import CausalLM
    torch.manual_seed(0)
    n = presets.PRESETS[name].n_layers
    return CausalLM(presets.get(name, n_layers=min(n, n_layers) if n < 10 else n_layers, **{**TINY, **kw})).eval()


def tiny_layout(layout: str, **kw):
    """A tiny transformer++-sized model of any layout string (the fields its letters leave out unwarned)."""
    import warnings

    from hybridlm import CausalLM
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # fields of letters this layout leaves out
        return CausalLM(presets.get("transformer++", **{**TINY, "layout": layout, **kw})).eval()


class ChatBytes(ByteTokenizer):
    """The byte tokenizer with a chat template (what a chat checkpoint's tokenizer carries)."""
    eos_token = "<eos>"
    chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>{% endif %}")


def free_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


@contextmanager
def live_server(model, tok=None, *, api_key=None, max_slots=4, block=16, prefix_cache_bytes=1 << 24,
                max_queue=64, max_body_bytes=1 << 16, memory_bytes=None):
    """(base url, scheduler) of a server running in a thread of this process, on a free loopback port."""
    import uvicorn
    from hybridlm.serve import Engine, Scheduler
    from hybridlm.serve.api import create_app
    tok = tok or ChatBytes()
    engine = Engine(model, eos_id=tok.eos_id, block=block, prefix_cache_bytes=prefix_cache_bytes,
                    max_slots=max_slots, memory_bytes=memory_bytes)
    sch = Scheduler(engine, max_queue=max_queue)
    app = create_app(sch, tok, "tiny", api_key=api_key, max_body_bytes=max_body_bytes)
    sock = free_port()
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=5))
    server.install_signal_handlers = lambda: None       # not the main thread
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not server.started:
        if time.time() > deadline or not th.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", sch
    finally:
        server.should_exit = True
        th.join(20)
        sock.close()
