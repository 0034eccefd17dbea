"""The proxy process of leader.py (TLLM_SPAWN_PROXY_PROCESS=1 puts the LLM API in a process of
its own): builds ``LLM(...)`` over a ``RemoteMpiCommSessionClient`` to the leader's session
server at argv[1], prints READY, then answers one command per stdin line with "OK ...":
generate, session (a task on the leader's session), shutdown (the LLM), quit."""
import os
import sys

from tensorrt_llm import LLM
from tensorrt_llm.llmapi.mpi_session import RemoteMpiCommSessionClient

client = RemoteMpiCommSessionClient(sys.argv[1])
llm = LLM("stand-in/tp2-multinode", tensor_parallel_size=2, mpi_session=client)
print("READY", flush=True)
for line in sys.stdin:
    command = line.strip()
    if command == "generate":
        print("OK", llm.generate("hello").outputs[0].text, flush=True)
    elif command == "session":
        print("OK", client.submit_sync(os.getpid), flush=True)
    elif command == "shutdown":
        llm.shutdown()
        print("OK", flush=True)
    elif command == "quit":
        client.shutdown()
        print("OK", flush=True)
        break
