"""The llama.cpp ``llama-server`` backend: start and supervise it, or attach by URL.

One module a job: where the binary and its libraries are (``binary``), its command line
and what its flags say (``command``), its process (``process``) and output
(``output``), whether it is up (``state``), the HTTP client and its one policy for
sending a call again (``client``), its JSON in strata-serve's types (``answers``), and
the backend that puts them together (``server``). llama-server's field names are read
in ``answers`` alone.
"""

from strata_serve.engine.llama_server.answers import read_llama_timings
from strata_serve.engine.llama_server.binary import (
    BINARY_NAME, ENGINE_DISTRIBUTION, library_dirs, packaged_binary, packaged_build, resolve_binary)
from strata_serve.engine.llama_server.stream import StreamReply
from strata_serve.engine.llama_server.command import build_command, clears_idle_slots, free_port, state_layout
from strata_serve.engine.llama_server.output import read_line_batches
from strata_serve.engine.llama_server.server import LlamaServer

__all__ = [
    "BINARY_NAME", "ENGINE_DISTRIBUTION", "LlamaServer", "StreamReply", "build_command", "clears_idle_slots",
    "free_port", "library_dirs", "packaged_binary", "packaged_build", "read_line_batches",
    "read_llama_timings", "resolve_binary", "state_layout",
]
