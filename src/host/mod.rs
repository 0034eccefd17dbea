//! What the machine is: the topology read from sysfs (CPUs, SMT siblings, NUMA nodes, caches,
//! GPUs), the cgroup limits, the GPUs this process sees and NVML's answers, the shapes of the
//! kernel's small text files, what a shared object needs from the loader, and the simulated hosts
//! that tests and the demo write. Facts only, no decision: uses only the root's leaves.

pub mod cgroup;
pub mod elf;
pub mod gpus;
pub mod kernel_text;
#[allow(unsafe_code)]
pub mod nvml;
#[cfg(any(test, feature = "simulated"))]
pub mod simulated;
pub mod topology;
