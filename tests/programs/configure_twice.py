"""seeds/configure-not-idempotent.txt, reproduced: six worker threads alive, policy unset,
configure called twice on the engine thread."""
import threading

from phases import LIB, note, phase, start

done = threading.Event()


def engine():
    note("engine")
    for i in range(6):
        start(f"w{i}")
    phase("start")
    first = LIB.tllm_affinity_configure(0)
    assert first > 0, first
    phase("first")
    start("between")
    second = LIB.tllm_affinity_configure(0)
    assert second > 0, second
    phase("second")
    start("later")
    phase("after")
    assert LIB.tllm_affinity_release(second) == 0
    assert LIB.tllm_affinity_release(first) == 0
    done.set()


note("main")
threading.Thread(target=engine, name="engine").start()
done.wait()
