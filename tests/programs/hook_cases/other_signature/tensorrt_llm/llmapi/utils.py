CALLS = []


def configure_cpu_affinity() -> None:
    CALLS.append(("configure", None))
