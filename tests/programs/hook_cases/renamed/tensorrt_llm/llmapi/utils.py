CALLS = []


def configure_worker_cpu_affinity(device_id: int) -> None:
    CALLS.append(("configure", device_id))


configure_cpu_affinity = None  # what a rename leaves behind for the importers below
