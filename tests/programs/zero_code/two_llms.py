"""seeds/configure-not-idempotent.txt as an unmodified app: LLM objects built one after another
on the main thread, each a single-process TP1 worker (TLLM_WORKER_USE_SINGLE_PROCESS=1, set by
the test), so configure_cpu_affinity runs once per LLM in one process. A user thread
(user_metrics) runs from the start.

Phases, printed by the main thread: before; first (llm1 built and used); second (llm2 built
while llm1 is alive); first_down (llm1 shut down); third (llm3 built after llm1's shutdown);
end (llm2 and llm3 shut down). Imports only tensorrt_llm and the test instrumentation.
"""
import threading

from phases import phase_all
from runtime_helpers import say
from tensorrt_llm import LLM

done = threading.Event()
threading.Thread(target=done.wait, name="user_metrics", daemon=True).start()
phase_all("before")

llm1 = LLM("stand-in/first")
say("ANSWER", llm1.generate("one").outputs[0].text)
phase_all("first")

llm2 = LLM("stand-in/second")
say("ANSWER", llm2.generate("two").outputs[0].text)
phase_all("second")

llm1.shutdown()
phase_all("first_down")

llm3 = LLM("stand-in/third")
say("ANSWER", llm3.generate("three").outputs[0].text)
phase_all("third")

llm2.shutdown()
llm3.shutdown()
phase_all("end")
done.set()
