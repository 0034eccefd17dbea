//! The aarch64 guest tier: the aarch64 build of the library, the command and the test programs
//! (zig cross-builds, as tests/emulated/aarch64.rs) on a real arm64 kernel (Debian's), in a guest shaped
//! like a GB200 compute tray at small scale: two Grace nodes with CPUs and memory and no SMT,
//! the GPU's memory as a CPU-less node with memory at a sparse id, a real tray's kind of
//! distances, and the "GPU" (QEMU's `pci-testdev`) on a Grace node.
//!
//! The guest boots under QEMU's `virt` machine with software emulation (TCG) through virtme-ng
//! (tests/common/guest.rs, the x86_64 guest tier's harness), over an arm64 Debian root file
//! system of its own (debootstrap, with the kernel's modules, udev and kmod), made once and kept
//! in /var/cache/tllm-affinity. This checkout and its target directory are bound read-only at
//! their own paths inside, so the script and the programs are where they are here.
//!
//! Three kernels: Debian's arm64 kernel with 4 KiB pages (bookworm, 6.1), its kernel with
//! 16 KiB pages (`linux-image-arm64-16k`, 6.12 from bookworm-backports) and a kernel with 64 KiB
//! pages, as NVIDIA ships Grace kernels (512 MiB transparent huge pages): Debian packages none,
//! so the test cross-builds one from Debian's `linux-source-6.1` with `gcc-aarch64-linux-gnu`
//! (tests/guest/arm64_64k_kernel.sh, the symbols of tests/guest/arm64_64k.config, everything
//! built in), once, cached in /var/cache/tllm-affinity under the hash of its configuration. The
//! 16 KiB and 64 KiB kernels run on QEMU's `-cpu neoverse-n1`, since vng's default Cortex-A57
//! has no 16 KiB granule. All boot over the same root filesystem, which holds the packaged
//! kernels' modules. The 4 KiB kernel boots the tray in NUMA mode (the GPU's memory a node of
//! its own); the 16 KiB kernel boots it in CDMM mode (no GPU-memory node, NVML's NUMA-node query
//! not supported); the 64 KiB kernel in NUMA mode with Grace nodes large enough for 512 MiB huge
//! pages: the same scenarios (tests/guest/gb200.sh) and the same checks, each test run on every
//! boot. Each boot also runs the memory moves with NUMA balancing off (Grace's recommended
//! setting), so no check leans on its hinting faults.
//!
//! Under device-tree boot QEMU's `virt` gives its PCI devices no NUMA node. For the GPU on a
//! Grace node the test dumps the machine's device tree, gives the PCI host bridge a
//! `numa-node-id` with `dtc`, and boots with that tree; a third boot (4 KiB pages) keeps QEMU's
//! own tree, where the device's `numa_node` is -1 (as on a DGX Spark) and NVML's CPU affinity
//! must decide.
//!
//! The 4 KiB NUMA-mode boot has a second GPU, on the other Grace node (node 0), with its memory
//! on node 2: a `pci-testdev` behind QEMU's PCI Express expander bridge (`pxb-pcie`, root bus
//! 0x80). Linux's generic ECAM host driver does not find an expander's root bus from bus 0, so
//! the edited device tree splits QEMU's host bridge in two, the second (buses 0x80-0xff, PCI
//! domain 1) with `numa-node-id = <0>`.
//!
//! What is real: the arm64 kernel, its masks, NUMA nodes, memory and page placement, PCI
//! locality. What is a test double: NVML alone (`tests/programs/nvml_double.c`).
//!
//! Needs root (the root filesystem is made with debootstrap and chroot), `qemu-system-aarch64`,
//! `dtc`, virtme-ng and the arm64 kernels `scripts/setup` unpacks; without them the tests skip,
//! and fail in CI.
//!
//! Run alone: `cargo test --release --test guests -- guest_aarch64:: --nocapture`.

use crate::common;

use common::guest::*;
use common::*;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

/// One boot attempt's limit. The arm64 guest boots in 15–30 s under TCG on an idle machine;
/// its scenarios run emulated too, and the machine is shared.
const BOOT_LIMIT: Duration = Duration::from_secs(480);

/// Where `scripts/setup` unpacks Debian's arm64 kernel packages (boot/, lib/modules/): the
/// 4 KiB-page kernel and the 16 KiB-page one.
const ARM64_KERNEL: &str = "/var/cache/tllm-affinity/arm64-kernel";
const ARM64_16K_KERNEL: &str = "/var/cache/tllm-affinity/arm64-16k-kernel";
/// The 64 KiB-page kernel's source (Debian's `linux-source-6.1`, which scripts/setup installs)
/// and the cross-compiler it is built with (`gcc-aarch64-linux-gnu`).
const LINUX_SOURCE: &str = "/usr/src/linux-source-6.1.tar.xz";
const CROSS_GCC: &str = "aarch64-linux-gnu-gcc";

/// The GPU's PCI address in the guest: `pci-testdev` at slot 2 of the root bus.
const GUEST_GPU: &str = "0000:00:02.0";
/// The Grace node the GPU is attached to, and its CPUs.
const GRACE_NODE: usize = 1;
const GRACE_CPUS: &str = "2-3";
/// GPU 1 of the 4 KiB NUMA-mode boot: a second `pci-testdev` behind a root port of a second PCI
/// host bridge (QEMU's `pxb-pcie`, root bus 0x80), which the edited device tree declares as a
/// host of its own (PCI domain 1) on the other Grace node, node 0.
const SECOND_GPU: &str = "0001:81:00.0";
const SECOND_GRACE_NODE: usize = 0;
const SECOND_GRACE_CPUS: &str = "0-1";
/// GPU 1's memory in NUMA mode: node 2, with memory and no CPU (on a tray the GPU memory of
/// Grace node 0's first GPU is node 2).
const SECOND_GPU_MEMORY_NODE: usize = 2;
/// The GPU's memory in NUMA mode: a CPU-less node with memory, at a sparse id. QEMU 7.2 wants
/// every node id below the highest to exist ("numa: Node ID missing: 9"), so nodes 2-9 are given
/// with neither CPUs nor memory: the kernel shows them online and empty, as a tray shows its
/// per-GPU placeholder nodes. In CDMM mode node 10 is such a placeholder too.
const GPU_MEMORY_NODE: usize = 10;
const ALL4: &str = "0-3";

/// The kernel a guest boots: its page size.
#[derive(Clone, Copy, Debug, PartialEq)]
enum PageSize {
    K4,
    K16,
    K64,
}

impl PageSize {
    fn bytes(self) -> usize {
        match self {
            PageSize::K4 => 4096,
            PageSize::K16 => 16384,
            PageSize::K64 => 65536,
        }
    }

    /// The PMD-sized transparent huge page: 512 base pages of 4 KiB, 2048 of 16 KiB, 8192 of
    /// 64 KiB.
    fn huge_page_kib(self) -> u64 {
        match self {
            PageSize::K4 => 2 << 10,
            PageSize::K16 => 32 << 10,
            PageSize::K64 => 512 << 10,
        }
    }

    /// Each Grace node's memory: 1 GiB, and 4 GiB under 64 KiB pages, where a huge page is
    /// 512 MiB, a whole page block (the THP scenario's buffer holds two on node 0, and the
    /// target keeps a free block of that size beside them).
    fn grace_node_mib(self) -> u64 {
        match self {
            PageSize::K64 => 4 << 10,
            _ => 1 << 10,
        }
    }

    /// QEMU's CPU: vng's default for arm64 under TCG (Cortex-A57) has no 16 KiB translation
    /// granule, and the 16 KiB kernel then hangs before its first line. Neoverse N1 has it, and
    /// costs less to emulate than `max` (no SVE, no pointer authentication).
    fn qemu_cpu(self) -> &'static str {
        match self {
            PageSize::K4 => "",
            PageSize::K16 | PageSize::K64 => "-cpu neoverse-n1 ",
        }
    }
}

/// Where the GPU's memory is: NUMA mode (node 10, named by NVML) or CDMM (no node; NVML's
/// NUMA-node query answers NOT_SUPPORTED, as the driver does then).
#[derive(Clone, Copy, Debug, PartialEq)]
enum GpuMemory {
    Numa,
    Cdmm,
}

/// One boot's shape: the kernel, the GPU-memory mode and how the GPU's PCI device gets its node.
#[derive(Clone, Copy)]
struct Shape {
    page: PageSize,
    gpu_memory: GpuMemory,
    device_node: DeviceNode,
    /// A second GPU on the other Grace node, with its own host bridge (and, in NUMA mode, its
    /// memory on node 2).
    two_gpus: bool,
    /// The guest script (tests/guest/).
    script: &'static str,
}

const NUMA_4K: Shape = Shape {
    page: PageSize::K4,
    gpu_memory: GpuMemory::Numa,
    device_node: DeviceNode::Grace,
    two_gpus: true,
    script: "gb200.sh",
};
const NO_NODE_4K: Shape = Shape {
    page: PageSize::K4,
    gpu_memory: GpuMemory::Numa,
    device_node: DeviceNode::None,
    two_gpus: false,
    script: "gb200_no_node.sh",
};
const CDMM_16K: Shape = Shape {
    page: PageSize::K16,
    gpu_memory: GpuMemory::Cdmm,
    device_node: DeviceNode::Grace,
    two_gpus: false,
    script: "gb200.sh",
};
const NUMA_64K: Shape = Shape {
    page: PageSize::K64,
    gpu_memory: GpuMemory::Numa,
    device_node: DeviceNode::Grace,
    two_gpus: false,
    script: "gb200.sh",
};

impl Shape {
    /// The GPU's memory node, in NUMA mode.
    fn gpu_memory_node(self) -> Option<usize> {
        (self.gpu_memory == GpuMemory::Numa).then_some(GPU_MEMORY_NODE)
    }

    /// GPU 1's memory node, in NUMA mode.
    fn second_gpu_memory_node(self) -> Option<usize> {
        (self.two_gpus && self.gpu_memory == GpuMemory::Numa).then_some(SECOND_GPU_MEMORY_NODE)
    }

    fn name(self) -> &'static str {
        match (self.page, self.gpu_memory, self.device_node) {
            (PageSize::K4, GpuMemory::Numa, DeviceNode::Grace) => {
                "GB200-like aarch64 (4 KiB pages, NUMA mode), GPUs 0 and 1 on Grace nodes 1 and 0"
            }
            (PageSize::K4, GpuMemory::Numa, DeviceNode::None) => {
                "GB200-like aarch64 (4 KiB pages, NUMA mode), the GPU without a NUMA node"
            }
            (PageSize::K16, GpuMemory::Cdmm, DeviceNode::Grace) => {
                "GB200-like aarch64 (16 KiB pages, CDMM mode), the GPU on Grace node 1"
            }
            (PageSize::K64, GpuMemory::Numa, DeviceNode::Grace) => {
                "GB200-like aarch64 (64 KiB pages, NUMA mode), the GPU on Grace node 1"
            }
            _ => "GB200-like aarch64",
        }
    }

    /// A short tag for the files made for this shape's boot.
    fn tag(self) -> String {
        format!(
            "{:?}-{:?}-{:?}",
            self.page, self.gpu_memory, self.device_node
        )
        .to_lowercase()
    }
}

/// The guest machine: node 0 = CPUs 0-1, node 1 = CPUs 2-3 (1 GiB each, 4 GiB under 64 KiB
/// pages: [`PageSize::grace_node_mib`]), node 10 = 512 MiB and
/// no CPU in NUMA mode (an empty placeholder in CDMM mode), and with two GPUs in NUMA mode node 2
/// = 256 MiB and no CPU (GPU 1's memory); distances of a tray: 40 between the Grace nodes, 80
/// from a Grace node to the memory of its own GPU, 120 to another's (and to the placeholders).
fn gb200_machine(shape: Shape, qemu_opts: String) -> Machine {
    let nodes = 0..=GPU_MEMORY_NODE;
    let second_gpu_memory = shape.second_gpu_memory_node().is_some();
    let mut distances = Vec::new();
    for a in nodes.clone() {
        for b in a + 1..=GPU_MEMORY_NODE {
            let d = match (a, b) {
                (0, 1) => 40,
                (GRACE_NODE, GPU_MEMORY_NODE) => 80,
                (SECOND_GRACE_NODE, SECOND_GPU_MEMORY_NODE) if second_gpu_memory => 80,
                _ => 120,
            };
            distances.push(format!("{a},{b}={d}"));
        }
    }
    let grace_mib = shape.page.grace_node_mib();
    let (gpu_memory_node, gpu_mib) = match (shape.gpu_memory, second_gpu_memory) {
        (GpuMemory::Numa, true) => ("512M,nodeid=10", 768),
        (GpuMemory::Numa, false) => ("512M,nodeid=10", 512),
        (GpuMemory::Cdmm, _) => ("0,nodeid=10", 0),
    };
    let memory = format!("{}M", 2 * grace_mib + gpu_mib);
    let node2 = if second_gpu_memory {
        "256M,nodeid=2"
    } else {
        "0,nodeid=2"
    };
    // The second GPU: a PCI Express expander bridge (a host bridge of its own to the guest, root
    // bus 0x80; QEMU's `numa_node=` for it reaches only ACPI tables, which a device-tree boot
    // has none of: the edited device tree gives its node), a root port on it (pxb-pcie takes
    // only bridges) and the device behind that.
    let second_gpu = if shape.two_gpus {
        [
            "-device pxb-pcie,id=pxb,bus_nr=0x80,bus=pcie.0,addr=0x3",
            "-device pcie-root-port,id=pxb_port,bus=pxb,chassis=1",
            "-device pci-testdev,bus=pxb_port ",
        ]
        .join(" ")
    } else {
        String::new()
    };
    // Machine holds 'static strings: a few bytes per boot.
    let node0: &'static str = format!("{grace_mib}M,cpus=0-1").leak();
    let node1: &'static str = format!("{grace_mib}M,cpus=2-3").leak();
    let numa: Vec<&'static str> = [
        node0,
        node1,
        node2,
        "0,nodeid=3",
        "0,nodeid=4",
        "0,nodeid=5",
        "0,nodeid=6",
        "0,nodeid=7",
        "0,nodeid=8",
        "0,nodeid=9",
        gpu_memory_node,
    ]
    .into();
    Machine {
        name: shape.name(),
        cpus: 4,
        memory: memory.leak(),
        // Machine holds 'static lists: a few bytes per boot.
        numa: numa.leak(),
        qemu_opts: format!(
            "{}-device pci-testdev,bus=pcie.0,addr=0x2 {second_gpu}{qemu_opts}",
            shape.page.qemu_cpu()
        ),
        distances,
        nodes: "0-10",
        script: shape.script,
        program: "numa_placement",
        deployments: false,
    }
}

/// What the guest needs from this machine: vng, the arm64 kernel, its root filesystem, dtc.
struct Tools {
    vng: Vng,
    kernel: Kernel,
    rootfs: PathBuf,
}

/// What a boot on the kernel with `page`-sized pages needs. The root filesystem is the 4 KiB
/// kernel's (made with its modules), with the 16 KiB kernel's modules added; the 64 KiB kernel
/// has none (everything it needs is built in).
fn tools(page: PageSize) -> Result<Tools, String> {
    if !root() {
        return Err(
            "root (the guest's root filesystem is made with debootstrap and chroot)".into(),
        );
    }
    for (tool, package) in [
        ("qemu-system-aarch64", "qemu-system-arm"),
        ("dtc", "device-tree-compiler"),
        ("depmod", "kmod"),
        ("cargo-zigbuild", "cargo-zigbuild, from pip"),
    ] {
        if !on_path(tool) {
            return Err(format!("`{tool}` ({package}; scripts/setup installs it)"));
        }
    }
    let vng = vng()?;
    let unpacked = |dir: &str, package: &str| {
        newest_kernel(&Path::new(dir).join("boot")).ok_or(format!(
            "the arm64 kernel: no {dir}/boot/vmlinuz-* (scripts/setup unpacks Debian's {package} \
             there)"
        ))
    };
    let base = unpacked(ARM64_KERNEL, "linux-image-arm64")?;
    let rootfs = guest_rootfs(&base)?;
    let kernel = match page {
        PageSize::K4 => base,
        PageSize::K16 => {
            let kernel = unpacked(
                ARM64_16K_KERNEL,
                "linux-image-arm64-16k (bookworm-backports)",
            )?;
            with_modules_of(&rootfs, &kernel, ARM64_16K_KERNEL)?;
            kernel
        }
        PageSize::K64 => kernel_with_64k_pages()?,
    };
    Ok(Tools {
        vng,
        kernel,
        rootfs,
    })
}

/// Debian bookworm for arm64 with what the guest's init needs (udev, kmod, busybox-static for
/// its initramfs and `poweroff`) and the 4 KiB kernel's modules, made once per release of that
/// kernel: debootstrap's second stage runs under qemu-user (binfmt_misc, as for
/// tests/emulated/aarch64.rs), about 5 minutes.
fn guest_rootfs(kernel: &Kernel) -> Result<PathBuf, String> {
    let release = &kernel.release;
    let rootfs = debootstrapped(
        &format!("bookworm-arm64-guest-{release}"),
        &format!("lib/modules/{release}/modules.dep"),
        &format!(
            "an arm64 guest root filesystem: `debootstrap --arch=arm64 bookworm {MIRROR}` with \
             the modules of {release}"
        ),
        |partial| {
            Command::new("sh")
                .arg("-c")
                .arg(
                    r#"set -e; partial=$1 mirror=$2 modules=$3 release=$4
                    debootstrap --arch=arm64 --foreign --variant=minbase \
                        --include=udev,kmod,numactl,busybox-static bookworm "$partial" "$mirror"
                    chroot "$partial" /debootstrap/debootstrap --second-stage
                    mkdir -p "$partial/lib/modules"
                    cp -a "$modules/$release" "$partial/lib/modules/"
                    depmod -b "$partial" "$release"
                    [ -e "$partial/usr/sbin/poweroff" ] || [ -e "$partial/sbin/poweroff" ] ||
                        ln -s /bin/busybox "$partial/usr/local/sbin/poweroff""#,
                )
                .arg("sh")
                .arg(partial)
                .arg(MIRROR)
                .arg(Path::new(ARM64_KERNEL).join("lib/modules"))
                .arg(release)
                .output()
                .unwrap()
        },
    )?;
    Ok(rootfs)
}

/// The 64 KiB-page kernel, built once per configuration: tests/guest/arm64_64k_kernel.sh with
/// the symbols of tests/guest/arm64_64k.config, into
/// `/var/cache/tllm-affinity/arm64-64k-kernel-<hash>`, the hash taken over that file, the
/// script and the source package's version, so that a change to any of them builds anew. The
/// build (minutes) runs under a lock, in a directory of its own renamed into place when done.
fn kernel_with_64k_pages() -> Result<Kernel, String> {
    use std::os::fd::AsRawFd;
    for (tool, package) in [
        (CROSS_GCC, "gcc-aarch64-linux-gnu"),
        ("flex", "flex"),
        ("bison", "bison"),
        ("bc", "bc"),
        ("sha256sum", "coreutils"),
    ] {
        if !on_path(tool) {
            return Err(format!("`{tool}` ({package}; scripts/setup installs it)"));
        }
    }
    if !Path::new(LINUX_SOURCE).is_file() {
        return Err(format!(
            "{LINUX_SOURCE} (linux-source-6.1; scripts/setup installs it)"
        ));
    }
    let fragment = repo().join("tests/guest/arm64_64k.config");
    let script = repo().join("tests/guest/arm64_64k_kernel.sh");
    let version =
        succeeded(Command::new("dpkg-query").args(["-W", "-f=${Version}", "linux-source-6.1"]))
            .stdout;
    let hashed = succeeded(
        Command::new("sh")
            .arg("-c")
            .arg(r#"{ cat "$1" "$2"; echo "$3"; } | sha256sum"#)
            .arg("sh")
            .arg(&fragment)
            .arg(&script)
            .arg(String::from_utf8_lossy(&version).trim()),
    )
    .stdout;
    let key = String::from_utf8_lossy(&hashed[..16]).to_string();
    let cache = Path::new(ROOTFS_CACHE);
    let dir = cache.join(format!("arm64-64k-kernel-{key}"));
    std::fs::create_dir_all(cache).unwrap();
    let lock = std::fs::File::create(format!("{}.lock", dir.display())).unwrap();
    // SAFETY: flock on a descriptor this function owns; closing it releases the lock.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    if let Some(kernel) = newest_kernel(&dir.join("boot")) {
        return Ok(kernel);
    }
    let partial = cache.join(format!(
        "arm64-64k-kernel-{key}.partial.{}",
        std::process::id()
    ));
    let started = std::time::Instant::now();
    let out = Command::new("sh")
        .arg(&script)
        .arg(LINUX_SOURCE)
        .arg(&fragment)
        .arg(&partial)
        .output()
        .unwrap();
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&partial);
        let log = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = log.lines().rev().take(3).collect();
        return Err(format!(
            "the 64 KiB-page kernel did not build: {}",
            tail.join(" | ")
        ));
    }
    println!(
        "built the 64 KiB-page arm64 kernel in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    std::fs::rename(&partial, &dir).unwrap();
    newest_kernel(&dir.join("boot")).ok_or(format!(
        "tests/guest/arm64_64k_kernel.sh left no {}/boot/vmlinuz-*",
        dir.display()
    ))
}

/// `kernel`'s modules (from `kernel_dir`, where scripts/setup unpacked its package) added to the
/// guest's root filesystem, once: a second kernel boots over the same root filesystem instead of
/// a second debootstrap. They are decompressed there (Debian compresses the 6.12 kernel's with
/// xz, which the emulated guest's udev would undo at every boot). Its `modules.dep`, written
/// last, says they are there.
fn with_modules_of(rootfs: &Path, kernel: &Kernel, kernel_dir: &str) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let release = &kernel.release;
    let lock = std::fs::File::create(format!("{}.modules.lock", rootfs.display())).unwrap();
    // SAFETY: flock on a descriptor this function owns; closing it releases the lock.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    if rootfs
        .join(format!("lib/modules/{release}/modules.dep"))
        .is_file()
    {
        return Ok(());
    }
    let out = Command::new("sh")
        .arg("-c")
        .arg(
            r#"set -e; rootfs=$1 modules=$2 release=$3
            rm -rf "$rootfs/lib/modules/$release"
            cp -a "$modules/$release" "$rootfs/lib/modules/"
            find "$rootfs/lib/modules/$release" -name '*.ko.xz' -print0 | xargs -0r -n 64 xz -d
            depmod -b "$rootfs" "$release""#,
        )
        .arg("sh")
        .arg(rootfs)
        .arg(Path::new(kernel_dir).join("lib/modules"))
        .arg(release)
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(format!(
            "the modules of {release} in {}: {}",
            rootfs.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// The aarch64 files the guest runs: the library, the command, the NVML double's directory,
/// numa_placement and memory_follows, in the order tests/guest/gb200*.sh take them; built once
/// for both boots.
fn aarch64_files() -> &'static [PathBuf] {
    static FILES: OnceLock<Vec<PathBuf>> = OnceLock::new();
    FILES.get_or_init(build_aarch64_files)
}

fn build_aarch64_files() -> Vec<PathBuf> {
    aarch64_wheel();
    let natives = aarch64_natives();
    let nvml_dir = for_aarch64(Program::c("nvml_double").shared())
        .named("aarch64/nvml/libnvidia-ml.so.1")
        .build()
        .parent()
        .unwrap()
        .to_path_buf();
    vec![
        natives.join("libtllm_affinity.so"),
        natives.join("tllm-affinity"),
        nvml_dir,
        arm64_program("numa_placement"),
        arm64_program("memory_follows"),
    ]
}

/// How the GPU's PCI device gets its node.
#[derive(Clone, Copy, Debug)]
enum DeviceNode {
    /// The host bridge's `numa-node-id` in an edited device tree: the Grace node.
    Grace,
    /// QEMU's own device tree: none (`numa_node` -1).
    None,
}

fn boot_gb200(shape: Shape) -> Result<Booted, NoBoot> {
    let tools = tools(shape.page).map_err(NoBoot::Missing)?;
    let files = aarch64_files();
    // The checkout (the scripts, target/zig) and cargo's target directory (the programs), bound
    // read-only at their paths; their mount points exist in the root filesystem.
    let target = target_dir().parent().unwrap().to_path_buf();
    let mut binds = vec![repo().to_path_buf()];
    if !target.starts_with(repo()) {
        binds.push(target);
    }
    let mut guest_args: Vec<OsString> = vec!["--arch".into(), "arm64".into(), "--root".into()];
    guest_args.push(tools.rootfs.clone().into());
    for dir in &binds {
        std::fs::create_dir_all(tools.rootfs.join(dir.strip_prefix("/").unwrap())).unwrap();
        // GUEST=HOST: a bare path must lie inside the guest's root.
        guest_args.push(format!("--rodir={0}={0}", dir.display()).into());
    }
    let exec = std::iter::once(repo().join("tests/guest").join(shape.script))
        .chain(files.iter().cloned())
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(" ");
    // gb200.sh's last arguments: the GPU's memory node, or "-" in CDMM mode; GPU 1's address
    // and memory node, or "-".
    let or_none = |node: Option<usize>| node.map_or("-".to_string(), |n| n.to_string());
    let gpu_memory_node = or_none(shape.gpu_memory_node());
    let second_gpu = match shape.two_gpus {
        true => format!("{SECOND_GPU} {}", or_none(shape.second_gpu_memory_node())),
        false => "- -".to_string(),
    };
    let exec = format!("sh {exec} {gpu_memory_node} {second_gpu}");
    let plain = gb200_machine(shape, String::new());
    let machine = match shape.device_node {
        DeviceNode::None => plain,
        DeviceNode::Grace => {
            let dtb =
                device_tree_with_the_bridge_on(&plain, shape, &tools, &guest_args, GRACE_NODE)
                    .map_err(NoBoot::Failed)?;
            gb200_machine(shape, format!("-dtb {}", dtb.display()))
        }
    };
    let mut args: Vec<OsString> = machine.vng_args().into_iter().map(Into::into).collect();
    args.extend(guest_args);
    boot(
        &Boot {
            machine: &machine,
            vng: &tools.vng,
            kernel: &tools.kernel,
            args,
            exec,
        },
        BOOT_LIMIT,
    )
}

/// The device tree QEMU makes for `machine` (dumped by the same vng command line, so the same
/// devices and memory), with `numa-node-id = <node>` on the PCI host bridge: every PCI device
/// then has that `numa_node`. With two GPUs the host bridge is split in two
/// ([`with_a_second_host_bridge`]).
fn device_tree_with_the_bridge_on(
    machine: &Machine,
    shape: Shape,
    tools: &Tools,
    guest_args: &[OsString],
    node: usize,
) -> Result<PathBuf, String> {
    let dir = target_dir().join("guest-aarch64");
    std::fs::create_dir_all(&dir).unwrap();
    let dumped = dir.join(format!("virt-{}.dtb", shape.tag()));
    let _ = std::fs::remove_file(&dumped);
    let mut args = machine.vng_args();
    let opts = args.pop().unwrap();
    args.push(format!("{opts} -machine dumpdtb={}", dumped.display()));
    let out = Command::new(&tools.vng.vng)
        .arg("--run")
        .arg(&tools.kernel.image)
        .args(args)
        .args(guest_args)
        .args(["--exec", "true"])
        .env("PATH", &tools.vng.path)
        .current_dir(repo())
        .output()
        .unwrap();
    if !dumped.is_file() {
        return Err(format!(
            "QEMU dumped no device tree for {}: {}",
            machine.name,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rfind(|l| !l.trim().is_empty())
                .unwrap_or("no output")
        ));
    }
    let source = succeeded(
        Command::new("dtc")
            .args(["-q", "-I", "dtb", "-O", "dts"])
            .arg(&dumped),
    );
    let source = String::from_utf8(source.stdout).unwrap();
    let source = if shape.two_gpus {
        with_a_second_host_bridge(&source, SECOND_GRACE_NODE)
            .map_err(|e| format!("{}: {e}", dumped.display()))?
    } else {
        source
    };
    let bridge = "\tpcie@10000000 {\n";
    if !source.contains(bridge) {
        return Err(format!(
            "no PCI host bridge `pcie@10000000` in {}",
            dumped.display()
        ));
    }
    let edited = source.replacen(
        bridge,
        &format!("{bridge}\t\tnuma-node-id = <{node:#x}>;\n"),
        1,
    );
    let dts = dir.join(format!("virt-{}-pci-node{node}.dts", shape.tag()));
    let dtb = dts.with_extension("dtb");
    std::fs::write(&dts, edited).unwrap();
    succeeded(
        Command::new("dtc")
            .args(["-q", "-I", "dts", "-O", "dtb", "-o"])
            .arg(&dtb)
            .arg(&dts),
    );
    Ok(dtb)
}

/// QEMU 7.2's `virt` PCI host bridge (dtc's text of it): buses 0-255 of high ECAM at
/// 0x40_1000_0000 (1 MiB a bus); 64 KiB of I/O at 0x3eff_0000; 32-bit memory from 0x1000_0000
/// to 0x3efe_ffff; 512 GiB of 64-bit memory at 0x80_0000_0000.
const QEMU_HOST_BRIDGE: [&str; 3] = [
    "bus-range = <0x00 0xff>;",
    "reg = <0x40 0x10000000 0x00 0x10000000>;",
    "ranges = <0x1000000 0x00 0x00 0x00 0x3eff0000 0x00 0x10000 0x2000000 0x00 0x10000000 0x00 \
     0x10000000 0x00 0x2eff0000 0x3000000 0x80 0x00 0x80 0x00 0x80 0x00>;",
];

/// The same resources split between two host bridges: buses 0-0x7f (the root bus, QEMU's
/// `pcie.0`) and 0x80-0xff (the expander bridge's root bus), each with its slice of ECAM (a bus
/// range's first bus at the start of its `reg`) and half of each window. The expander's root bus
/// decodes the addresses of the one PCI address space QEMU has, so any half serves.
const SPLIT_HOST_BRIDGES: [[&str; 3]; 2] = [
    [
        "bus-range = <0x00 0x7f>;",
        "reg = <0x40 0x10000000 0x00 0x8000000>;",
        "ranges = <0x1000000 0x00 0x00 0x00 0x3eff0000 0x00 0x8000 0x2000000 0x00 0x10000000 \
         0x00 0x10000000 0x00 0x10000000 0x3000000 0x80 0x00 0x80 0x00 0x40 0x00>;",
    ],
    [
        "bus-range = <0x80 0xff>;",
        "reg = <0x40 0x18000000 0x00 0x8000000>;",
        "ranges = <0x1000000 0x00 0x8000 0x00 0x3eff8000 0x00 0x8000 0x2000000 0x00 0x20000000 \
         0x00 0x20000000 0x00 0x1eff0000 0x3000000 0xc0 0x00 0xc0 0x00 0x40 0x00>;",
    ],
];

/// `source` (QEMU's device tree, as dtc writes it) with the PCI host bridge split in two
/// (`SPLIT_HOST_BRIDGES`): Linux's generic ECAM host driver scans a host's root bus and the
/// buses behind PCI-to-PCI bridges, and an expander bridge is neither, so its root bus (0x80)
/// needs a host node of its own. That node has PCI domain 1 (a domain is a host's own; Linux
/// refuses a domain twice) and `numa-node-id = <node>`.
fn with_a_second_host_bridge(source: &str, node: usize) -> Result<String, String> {
    let start = source
        .find("\tpcie@10000000 {\n")
        .ok_or("no PCI host bridge `pcie@10000000`")?;
    let end = start
        + source[start..]
            .find("\n\t};\n")
            .ok_or("the PCI host bridge's node does not end")?
        + "\n\t};\n".len();
    let bridge = &source[start..end];
    let split = |lines: [&str; 3]| -> Result<String, String> {
        let mut node = bridge.to_string();
        for (qemu, ours) in QEMU_HOST_BRIDGE.iter().zip(lines) {
            if !node.contains(qemu) {
                return Err(format!(
                    "the PCI host bridge has no `{qemu}` (QEMU 7.2's, which the test splits)"
                ));
            }
            node = node.replacen(qemu, ours, 1);
        }
        Ok(node)
    };
    let first = split(SPLIT_HOST_BRIDGES[0])?;
    let second = split(SPLIT_HOST_BRIDGES[1])?;
    let domain = "linux,pci-domain = <0x00>;";
    if !second.contains(domain) {
        return Err(format!("the PCI host bridge has no `{domain}`"));
    }
    let second = second
        .replacen(domain, "linux,pci-domain = <0x01>;", 1)
        .replacen(
            "\tpcie@10000000 {\n",
            &format!("\tpcie@4018000000 {{\n\t\tnuma-node-id = <{node:#x}>;\n"),
            1,
        );
    Ok(format!(
        "{}{first}\n{second}{}",
        &source[..start],
        &source[end..]
    ))
}

/// The GB200-like guest in NUMA mode on the 4 KiB kernel, the GPU on Grace node 1
/// (tests/guest/gb200.sh).
fn numa_4k() -> Result<&'static Booted, String> {
    static BOOT: OnceLock<Result<Booted, NoBoot>> = OnceLock::new();
    booted(&BOOT, || boot_gb200(NUMA_4K))
}

/// The same scenarios in CDMM mode on the 16 KiB kernel.
fn cdmm_16k() -> Result<&'static Booted, String> {
    static BOOT: OnceLock<Result<Booted, NoBoot>> = OnceLock::new();
    booted(&BOOT, || boot_gb200(CDMM_16K))
}

/// The 4 KiB NUMA-mode machine with the GPU's `numa_node` -1 (tests/guest/gb200_no_node.sh).
fn no_node() -> Result<&'static Booted, String> {
    static BOOT: OnceLock<Result<Booted, NoBoot>> = OnceLock::new();
    booted(&BOOT, || boot_gb200(NO_NODE_4K))
}

/// The same scenarios in NUMA mode on the 64 KiB kernel.
fn numa_64k() -> Result<&'static Booted, String> {
    static BOOT: OnceLock<Result<Booted, NoBoot>> = OnceLock::new();
    booted(&BOOT, || boot_gb200(NUMA_64K))
}

/// The boot of gb200.sh's `shape` (NUMA_4K, CDMM_16K or NUMA_64K).
fn gb200(shape: &Shape) -> Result<&'static Booted, String> {
    match shape.page {
        PageSize::K4 => numa_4k(),
        PageSize::K16 => cdmm_16k(),
        PageSize::K64 => numa_64k(),
    }
}

/// `key=value` lines of a scenario, as a map.
fn values(run: &Scenario) -> BTreeMap<String, String> {
    run.out
        .iter()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// At least 95 % of `pages` on `node`.
fn mostly_on(nodes: &BTreeMap<usize, usize>, node: usize, pages: usize) -> bool {
    nodes.get(&node).copied().unwrap_or(0) * 100 >= pages * 95
}

/// The 64 MiB buffer's and the 16 MiB bound buffer's size in 4 KiB units (memory_follows counts
/// in those whatever the kernel's page size).
const BUFFER_PAGES: usize = 16384;
const GPU_BUFFER_PAGES: usize = 4096;

table_tests! {
    check_the_guests_shape;
    /// 4 KiB pages, NUMA mode: two Grace nodes, placeholders 3-9, node 10 GPU 0's memory, node
    /// 2 GPU 1's.
    the_guest_is_aarch64_with_4k_pages_two_grace_nodes_and_a_gpu_memory_node: NUMA_4K;
    /// 16 KiB pages (32 MiB huge pages), CDMM mode: the Grace nodes, placeholders 2-10 and no
    /// node with memory but the Grace nodes.
    the_guest_is_aarch64_with_16k_pages_two_grace_nodes_and_no_gpu_memory_node: CDMM_16K;
    /// 64 KiB pages as NVIDIA ships Grace kernels (`getconf PAGESIZE` 65536, 512 MiB huge
    /// pages), NUMA mode: the Grace nodes, placeholders 2-9, node 10 the GPU's memory.
    the_guest_is_aarch64_with_64k_pages_two_grace_nodes_and_a_gpu_memory_node: NUMA_64K;
}

fn check_the_guests_shape(shape: &Shape) {
    let guest = require!(gb200(shape));
    let nodes = values(guest.ok("nodes"));
    println!(
        "tier: {} ({}) booted in {:.0} s\n{nodes:#?}",
        guest.machine,
        guest.kernel_release,
        guest.wall.as_secs_f64()
    );
    assert_eq!(nodes["arch"], "aarch64");
    assert_eq!(nodes["page_size"], shape.page.bytes().to_string());
    assert_eq!(
        nodes["hpage_pmd_kib"],
        shape.page.huge_page_kib().to_string()
    );
    assert_eq!(nodes["online"], "0-10", "placeholders 2-9 included");
    assert_eq!(nodes["has_cpu"], "0-1", "node 10 has no CPUs");
    assert_eq!(nodes["node0_cpus"], "0-1");
    assert_eq!(nodes["node1_cpus"], GRACE_CPUS);
    assert_eq!(nodes["node10_cpus"], "");
    let node10_kib: u64 = nodes["node10_memory_kib"].parse().unwrap();
    let node2_kib: u64 = nodes["node2_memory_kib"].parse().unwrap();
    match (shape.gpu_memory, shape.two_gpus) {
        (GpuMemory::Numa, true) => {
            assert_eq!(nodes["has_memory"], "0-2,10", "nodes 2 and 10 have memory");
            assert!(node10_kib > 400 << 10, "node 10's memory: {node10_kib} KiB");
            assert!(node2_kib > 200 << 10, "node 2's memory: {node2_kib} KiB");
        }
        (GpuMemory::Numa, false) => {
            assert_eq!(nodes["has_memory"], "0-1,10", "node 10 has memory");
            assert!(node10_kib > 400 << 10, "node 10's memory: {node10_kib} KiB");
        }
        (GpuMemory::Cdmm, _) => {
            assert_eq!(
                nodes["has_memory"], "0-1",
                "only the Grace nodes have memory"
            );
            assert_eq!(node10_kib, 0, "node 10's memory");
            assert_eq!(node2_kib, 0, "node 2's memory");
        }
    }
    // Linux 6.1 keeps the device tree's distances to every node; 6.12 keeps them only between
    // nodes with memory and gives the others its default remote distance, 20.
    let node1_distance = match shape.page {
        PageSize::K4 | PageSize::K64 => "40 10 120 120 120 120 120 120 120 120 80",
        PageSize::K16 => "40 10 20 20 20 20 20 20 20 20 20",
    };
    assert_eq!(nodes["node1_distance"], node1_distance, "{nodes:?}");
    // No SMT: each CPU is its own only sibling.
    assert_eq!(nodes["siblings"].trim_end(), "0 1 2 3", "{nodes:?}");
    assert_eq!(
        guest.ok("pci").out,
        [format!("{GRACE_NODE}"), GRACE_CPUS.to_string()],
        "{GUEST_GPU}'s numa_node and local_cpulist"
    );
}

table_tests! {
    check_placement;
    /// Workers and their children go to the GPU's Grace node, host threads stay, release
    /// restores; pages the workers first touched lie on the Grace node (4 KiB pages, NUMA mode).
    workers_go_to_the_gpus_grace_node_and_release_restores_4k_numa: NUMA_4K;
    /// The same on 16 KiB pages in CDMM mode, where NVML names no memory node.
    workers_go_to_the_gpus_grace_node_and_release_restores_16k_cdmm: CDMM_16K;
    /// The same on 64 KiB pages in NUMA mode.
    workers_go_to_the_gpus_grace_node_and_release_restores_64k_numa: NUMA_64K;
}

fn check_placement(shape: &Shape) {
    let guest = require!(gb200(shape));
    let run = guest.ok("placement");
    check_placement_and_release(run, GRACE_CPUS, ALL4, GUEST_GPU);
    // Pages the workers first touched: on their Grace node, none on the GPU's memory node.
    workers_pages_all_on(run, GRACE_NODE);
}

table_tests! {
    check_the_scopes_memory_preference;
    /// The scope's caller prefers the workers' node while its scope is open: a Grace node (node
    /// mask 2: node 1), never the GPU's memory node; host threads keep MPOL_DEFAULT.
    the_worker_scopes_memory_preference_is_the_grace_node_never_the_gpu_memory_node_4k_numa: NUMA_4K;
    /// The same in CDMM mode on 16 KiB pages.
    the_worker_scopes_memory_preference_is_the_grace_node_16k_cdmm: CDMM_16K;
    /// The same in NUMA mode on 64 KiB pages.
    the_worker_scopes_memory_preference_is_the_grace_node_never_the_gpu_memory_node_64k_numa: NUMA_64K;
}

fn check_the_scopes_memory_preference(shape: &Shape) {
    let guest = require!(gb200(shape));
    let run = guest.ok("placement");
    let words = |thread: &str, phase: &str| -> String {
        run.lines(&format!("POLICY {thread} "))
            .into_iter()
            .find(|w| w[0] == phase)
            .map(|w| w[1..].join(" "))
            .unwrap_or_else(|| panic!("no POLICY {thread} {phase}:\n{}", run.text()))
    };
    println!("scope: {}", words("main", "scope"));
    assert_eq!(
        words("main", "scope"),
        format!("1 {:x}", 1u64 << GRACE_NODE)
    );
    assert_eq!(words("main", "after_scope"), "0 0");
    host_threads_keep_the_default_policy(run);
}

table_tests! {
    check_the_dedicated_workers_memory_move;
    /// A dedicated worker that touched 64 MiB on Grace node 0 and bound 16 MiB to the GPU's
    /// memory node: after its configure for the GPU on node 1, ≥ 95 % of the 64 MiB is on node 1
    /// and none on node 10; the bound buffer stays on node 10, every page. In a shared process
    /// (configure on another thread) nothing moves.
    a_dedicated_workers_memory_goes_to_the_grace_node_and_gpu_memory_stays_4k_numa: NUMA_4K;
    /// The same on 16 KiB pages (numa_maps counts pages of 16 KiB) in CDMM mode, where there is
    /// no GPU-memory node to bind to.
    a_dedicated_workers_memory_goes_to_the_grace_node_16k_cdmm: CDMM_16K;
    /// The same on 64 KiB pages (the 64 MiB buffer is 1024 pages) in NUMA mode, the bound
    /// buffer on node 10.
    a_dedicated_workers_memory_goes_to_the_grace_node_and_gpu_memory_stays_64k_numa: NUMA_64K;
}

fn check_the_dedicated_workers_memory_move(shape: &Shape) {
    let guest = require!(gb200(shape));
    dedicated_workers_memory_moved(shape, guest.ok("dedicated"));
    let shared = guest.ok("shared");
    let (before, after) = (shared.pages("before").0, shared.pages("after").0);
    println!("shared process: before {before:?}, after {after:?}");
    assert!(mostly_on(&before, 0, BUFFER_PAGES), "before {before:?}");
    assert_eq!(after, before, "{}", shared.stderr());
    assert_eq!(shared.report()["worker_mask"], GRACE_CPUS);
}

/// memory_follows' dedicated worker (`run`): its 64 MiB went from node 0 to the Grace node, none
/// to the GPU's memory node, and its buffer bound to that node (NUMA mode) stayed there.
fn dedicated_workers_memory_moved(shape: &Shape, run: &Scenario) {
    let pages = |phase: &str| {
        let (nodes, failed) = run.pages(phase);
        assert_eq!(failed, 0, "{phase}:\n{}", run.text());
        nodes
    };
    check_numa_maps_page_size(run, shape.page);
    let (before, after) = (pages("before"), pages("after"));
    println!("dedicated: 64 MiB before {before:?}, after {after:?} (4 KiB units)");
    assert!(mostly_on(&before, 0, BUFFER_PAGES), "before {before:?}");
    assert!(
        mostly_on(&after, GRACE_NODE, BUFFER_PAGES),
        "after {after:?}\n{}",
        run.stderr()
    );
    assert_eq!(after.get(&GPU_MEMORY_NODE), None, "after {after:?}");
    match shape.gpu_memory_node() {
        Some(gpu_node) => {
            let (gpu_before, gpu_after) = (pages("gpu_before"), pages("gpu_after"));
            println!(
                "dedicated: 16 MiB bound to node {gpu_node} before {gpu_before:?}, after \
                 {gpu_after:?}"
            );
            assert_eq!(
                gpu_before,
                BTreeMap::from([(gpu_node, GPU_BUFFER_PAGES)]),
                "the program's own placement"
            );
            assert_eq!(gpu_after, gpu_before, "{}", run.stderr());
        }
        None => assert!(
            run.lines("PAGES gpu_").is_empty(),
            "no bound buffer without a GPU-memory node:\n{}",
            run.text()
        ),
    }
    let moved = &run.report()["memory_moved"];
    assert_eq!(moved["node"], GRACE_NODE, "{moved}");
}

/// numa_maps gave memory_follows' buffer in pages of the kernel's size, before and after.
fn check_numa_maps_page_size(run: &Scenario, page: PageSize) {
    for phase in ["before", "after"] {
        let kib = run
            .lines("PAGE_KB ")
            .into_iter()
            .find(|w| w[0] == phase)
            .unwrap_or_else(|| panic!("no PAGE_KB {phase}:\n{}", run.text()));
        assert_eq!(kib[1], (page.bytes() / 1024).to_string(), "{phase}");
    }
}

table_tests! {
    check_transparent_huge_pages;
    /// Transparent huge pages of 2 MiB (`always`, a 68 MiB buffer 1 MiB past a huge page
    /// boundary): none is split, they lie on the Grace node after the move, the report counts
    /// them.
    transparent_huge_pages_move_whole_to_the_grace_node_4k_numa: NUMA_4K;
    /// The same with the 32 MiB huge pages of 16 KiB pages (a 100 MiB buffer 16 MiB past a
    /// boundary).
    transparent_huge_pages_move_whole_to_the_grace_node_16k_cdmm: CDMM_16K;
    /// The same with the 512 MiB huge pages of 64 KiB pages (a 1540 MiB buffer 256 MiB past a
    /// boundary, two whole huge pages), on Grace nodes of 4 GiB.
    transparent_huge_pages_move_whole_to_the_grace_node_64k_numa: NUMA_64K;
}

fn check_transparent_huge_pages(shape: &Shape) {
    let guest = require!(gb200(shape));
    huge_pages_moved_whole(shape, guest.ok("thp"));
}

/// memory_follows' THP scenario (`run`): no huge page split, the buffer on the Grace node after,
/// and every huge page it had counted as moved, once.
fn huge_pages_moved_whole(shape: &Shape, run: &Scenario) {
    check_numa_maps_page_size(run, shape.page);
    let before = huge_pages_stay_whole(run);
    let buffer_pages: usize = run.pages("before").0.values().sum();
    let (pages, failed) = run.pages("after");
    let moved = run.report()["memory_moved"]["huge_pages_moved"]
        .as_u64()
        .unwrap_or(0);
    println!(
        "thp: AnonHugePages {before} kB before; {moved} huge pages moved; pages {pages:?} \
         (4 KiB units)"
    );
    let huge_kib = shape.page.huge_page_kib();
    assert!(
        before >= 2 * huge_kib,
        "two huge pages of {huge_kib} kB before: {before} kB\n{}",
        run.text()
    );
    assert_eq!(failed, 0);
    assert!(
        mostly_on(&pages, GRACE_NODE, buffer_pages),
        "{pages:?}\n{}",
        run.stderr()
    );
    assert!(
        moved * huge_kib >= before,
        "{moved} huge pages moved of {before} kB\n{}",
        run.stderr()
    );
}

table_tests! {
    check_ps_memory_per_node;
    /// `tllm-affinity ps` of a live configured process shows its memory per node, from
    /// numa_maps: the worker's and its child's buffers on the Grace node, in bytes.
    ps_shows_the_workers_memory_on_the_grace_node_4k_numa: NUMA_4K;
    /// The same where numa_maps counts pages of 16 KiB.
    ps_shows_the_workers_memory_on_the_grace_node_16k_cdmm: CDMM_16K;
    /// The same where numa_maps counts pages of 64 KiB.
    ps_shows_the_workers_memory_on_the_grace_node_64k_numa: NUMA_64K;
}

fn check_ps_memory_per_node(shape: &Shape) {
    let guest = require!(gb200(shape));
    let held = guest.ok("ps_numa_maps");
    let ps = guest.ok("ps_numa_maps_ps").json();
    let memory = &ps["memory"];
    println!("ps: {memory}");
    assert!(
        memory["source"]
            .as_str()
            .is_some_and(|s| s.contains("numa_maps")),
        "{memory}"
    );
    // What the held process itself counted there (move_pages, in the kernel's pages).
    let touched_pages: usize = ["worker", "child"]
        .iter()
        .map(|buffer| held.pages(buffer).0.get(&GRACE_NODE).copied().unwrap_or(0))
        .sum();
    let touched = (touched_pages * shape.page.bytes()) as u64;
    assert!(touched >= 8 << 20, "{}", held.text());
    let on_grace = memory["bytes_per_node"][GRACE_NODE.to_string()]
        .as_u64()
        .unwrap_or(0);
    assert!(on_grace >= touched, "{on_grace} < {touched}: {memory}");
    assert!(
        memory["bytes_per_node"][GPU_MEMORY_NODE.to_string()].is_null(),
        "{memory}"
    );
    ps_shows_a_worker_on(&ps, GRACE_CPUS);
}

table_tests! {
    check_topo_plan_and_configure;
    /// NUMA mode: topo names it and node 10 as the GPU's memory (from NVML); topo, plan and
    /// configure agree on the Grace node's CPUs.
    topo_plan_and_configure_agree_on_the_grace_node_4k_numa: NUMA_4K;
    /// CDMM mode: topo names it and no memory node for the GPU; workers still go to the Grace
    /// node, from the PCI bridge's node and NVML's CPU affinity.
    topo_plan_and_configure_agree_on_the_grace_node_16k_cdmm: CDMM_16K;
    /// NUMA mode on 64 KiB pages: as on 4 KiB pages.
    topo_plan_and_configure_agree_on_the_grace_node_64k_numa: NUMA_64K;
}

fn check_topo_plan_and_configure(shape: &Shape) {
    let guest = require!(gb200(shape));
    let configured = guest.ok("placement").mask("configured", "W").0;
    let topo = guest.ok("topo").json();
    let plan = guest.ok("plan").json();
    let text = guest.ok("topo_text").text();
    println!("topo nodes: {}\nplan: {plan}\n{text}", topo["nodes"]);
    assert_eq!(topo["online"], ALL4, "{topo}");
    let device = &topo["visible"]["devices"][0];
    assert_eq!(device["address"], GUEST_GPU, "{topo}");
    assert_eq!(plan["gpu"]["address"], GUEST_GPU, "{plan}");
    assert_eq!(plan["gpu"]["numa_node"], GRACE_NODE, "{plan}");
    let gpu = &topo["gpus"][0];
    let node10 = row(&topo, "nodes", "id", GPU_MEMORY_NODE);
    assert_eq!(node10["cpus"], "", "{node10}");
    let mode_line = text.lines().find(|l| l.starts_with("GPU memory: "));
    let gpu_line = text
        .lines()
        .find(|l| l.contains(GUEST_GPU) && l.contains("its memory on"));
    match shape.gpu_memory {
        GpuMemory::Numa => {
            // NVML names node 10 as the GPU's memory: topo says so, and nothing runs there.
            assert_eq!(topo["gpu_memory_mode"], "numa", "{topo}");
            assert_eq!(gpu["memory_node"], GPU_MEMORY_NODE, "{gpu}");
            assert_eq!(gpu["memory_node_from"], "nvml", "{gpu}");
            assert_eq!(node10["has_memory"], true, "{node10}");
            assert_eq!(node10["gpu_memory_of"][0]["address"], GUEST_GPU, "{node10}");
            assert!(
                mode_line.is_some_and(|l| l.starts_with("GPU memory: NUMA mode")),
                "{text}"
            );
            assert!(
                gpu_line.is_some_and(|l| l.contains("its memory on node 10 (from NVML)")),
                "{text}"
            );
        }
        GpuMemory::Cdmm => {
            assert_eq!(topo["gpu_memory_mode"], "cdmm", "{topo}");
            assert!(gpu["memory_node"].is_null(), "{gpu}");
            assert_eq!(node10["has_memory"], false, "{node10}");
            assert_eq!(node10["gpu_memory_of"], serde_json::json!([]), "{node10}");
            assert!(
                mode_line.is_some_and(|l| l.starts_with("GPU memory: CDMM mode")),
                "{text}"
            );
            assert!(
                gpu_line.is_some_and(|l| l.contains("its memory on no NUMA node")),
                "{text}"
            );
        }
    }
    topo_plan_and_configure_agree(device, &plan, &configured, GRACE_CPUS);
}

table_tests! {
    check_the_move_with_numa_balancing_off;
    /// With NUMA balancing off (`kernel.numa_balancing` 0, Grace's recommended setting) the
    /// dedicated worker's move and the huge pages' hold as with it on, and the kernel's
    /// hinting-fault path moved no page meanwhile (4 KiB pages).
    the_move_holds_with_numa_balancing_off_4k_numa: NUMA_4K;
    /// The same on 16 KiB pages.
    the_move_holds_with_numa_balancing_off_16k_cdmm: CDMM_16K;
    /// The same on 64 KiB pages, the 512 MiB huge pages moved whole.
    the_move_holds_with_numa_balancing_off_64k_numa: NUMA_64K;
}

fn check_the_move_with_numa_balancing_off(shape: &Shape) {
    let guest = require!(gb200(shape));
    assert_eq!(
        guest.ok("balancing_off").out,
        ["0"],
        "kernel.numa_balancing"
    );
    for name in ["dedicated_balancing_off", "thp_balancing_off"] {
        let run = guest.ok(name);
        let fault_moves = run
            .lines("FAULT_MOVES ")
            .first()
            .map(|w| w[0].clone())
            .unwrap_or_else(|| panic!("no FAULT_MOVES:\n{}", run.text()));
        assert_eq!(fault_moves, "0", "{name}: hinting faults moved pages");
    }
    dedicated_workers_memory_moved(shape, guest.ok("dedicated_balancing_off"));
    huge_pages_moved_whole(shape, guest.ok("thp_balancing_off"));
}

table_tests! {
    check_a_budget_smaller_than_a_huge_page;
    /// `TLLM_AFFINITY_MOVE_MEMORY` of half a huge page (1 MiB): no huge page moves, none is
    /// split, the move stays within the budget, and the log says the huge pages stay because
    /// each is larger than what the budget left (4 KiB pages).
    a_budget_smaller_than_a_huge_page_moves_none_and_says_so_4k_numa: NUMA_4K;
    /// The same with 32 MiB huge pages and a 16 MiB budget.
    a_budget_smaller_than_a_huge_page_moves_none_and_says_so_16k_cdmm: CDMM_16K;
    /// The same with 512 MiB huge pages and a 256 MiB budget.
    a_budget_smaller_than_a_huge_page_moves_none_and_says_so_64k_numa: NUMA_64K;
}

fn check_a_budget_smaller_than_a_huge_page(shape: &Shape) {
    let guest = require!(gb200(shape));
    let run = guest.ok("thp_budget");
    let budget = shape.page.huge_page_kib() * 1024 / 2;
    let before = huge_pages_stay_whole(run);
    let report = run.report();
    let moved = &report["memory_moved"];
    println!(
        "budget {budget} B: AnonHugePages {before} kB before; moved {moved}\n{}",
        run.stderr()
    );
    assert!(
        before >= 2 * shape.page.huge_page_kib(),
        "two huge pages before: {before} kB\n{}",
        run.text()
    );
    assert_eq!(moved["huge_pages_moved"], 0, "{moved}");
    let bytes = moved["bytes_moved"].as_u64().unwrap_or(0);
    assert!(
        bytes <= budget,
        "{bytes} B moved over the {budget} B budget"
    );
    let said = run
        .err
        .iter()
        .find(|l| l.contains("huge pages of") && l.contains("stay whole"));
    assert!(
        said.is_some_and(|l| l.contains("larger than what TLLM_AFFINITY_MOVE_MEMORY's budget")),
        "no line saying the huge pages stay for the budget:\n{}",
        run.stderr()
    );
}

/// GPU 1 of the 4 KiB NUMA-mode boot, behind a host bridge of its own (the device tree's second
/// PCI host node, domain 1) on Grace node 0, while GPU 0's bridge is on node 1: sysfs gives each
/// device its node and CPUs; `topo` shows both GPUs, GPU 1 on node 0 with its memory on node 2
/// (from NVML); `topo`, `plan --gpu 1` and a real `configure(1)` name node 0's CPUs.
#[test]
fn two_gpus_on_two_grace_nodes_topo_plan_and_configure_give_each_its_nodes_cpus() {
    let guest = require!(numa_4k());
    assert_eq!(
        guest.ok("pci").out,
        [GRACE_NODE.to_string(), GRACE_CPUS.to_string()],
        "{GUEST_GPU}'s numa_node and local_cpulist"
    );
    assert_eq!(
        guest.ok("pci_second").out,
        [SECOND_GRACE_NODE.to_string(), SECOND_GRACE_CPUS.to_string()],
        "{SECOND_GPU}'s numa_node and local_cpulist"
    );
    let topo = guest.ok("topo").json();
    let plan = guest.ok("plan_gpu1").json();
    let text = guest.ok("topo_text").text();
    let configured = guest.ok("placement_gpu1").mask("configured", "W").0;
    println!(
        "topo gpus: {}
plan --gpu 1: {plan}
{text}",
        topo["gpus"]
    );
    let devices = topo["visible"]["devices"].as_array().unwrap();
    let addresses: Vec<&serde_json::Value> = devices.iter().map(|d| &d["address"]).collect();
    assert_eq!(addresses, [GUEST_GPU, SECOND_GPU], "{topo}");
    for (index, address, node) in [
        (0, GUEST_GPU, GRACE_NODE),
        (1, SECOND_GPU, SECOND_GRACE_NODE),
    ] {
        let gpu = &topo["gpus"][index];
        assert_eq!(gpu["address"], address, "{gpu}");
        assert_eq!(gpu["numa_node"], node, "{gpu}");
    }
    let gpu1 = &topo["gpus"][1];
    assert_eq!(gpu1["memory_node"], SECOND_GPU_MEMORY_NODE, "{gpu1}");
    assert_eq!(gpu1["memory_node_from"], "nvml", "{gpu1}");
    let node2 = row(&topo, "nodes", "id", SECOND_GPU_MEMORY_NODE);
    assert_eq!(node2["cpus"], "", "{node2}");
    assert_eq!(node2["gpu_memory_of"][0]["address"], SECOND_GPU, "{node2}");
    assert!(
        text.lines().any(|l| l.contains(SECOND_GPU)
            && l.contains(&format!(
                "its memory on node {SECOND_GPU_MEMORY_NODE} (from NVML)"
            ))),
        "{text}"
    );
    assert_eq!(plan["gpu"]["address"], SECOND_GPU, "{plan}");
    assert_eq!(plan["gpu"]["numa_node"], SECOND_GRACE_NODE, "{plan}");
    assert_eq!(
        plan["worker"]["source"], "the GPU's PCI local_cpulist",
        "{plan}"
    );
    topo_plan_and_configure_agree(&devices[1], &plan, &configured, SECOND_GRACE_CPUS);
}

/// `configure(1)` in a real process: GPU 1's workers and their children go to Grace node 0's
/// CPUs, where GPU 0's went to node 1's; host threads stay, release restores; the pages its
/// workers first touched lie on node 0. The CPUs come from the kernel's PCI locality of the
/// device: NVML's CPU affinity (the same CPUs, as on a tray) is the library's fallback where
/// sysfs has no node for the GPU, and it says so when it takes it.
#[test]
fn gpu_1s_workers_go_to_the_other_grace_node_and_release_restores() {
    let guest = require!(numa_4k());
    let gpu0_workers = guest.ok("placement").mask("configured", "W").0;
    assert_eq!(gpu0_workers, GRACE_CPUS, "GPU 0's workers");
    assert_eq!(
        guest.ok("pci_second").out,
        [SECOND_GRACE_NODE.to_string(), SECOND_GRACE_CPUS.to_string()],
        "{SECOND_GPU}'s numa_node and local_cpulist"
    );
    let run = guest.ok("placement_gpu1");
    check_placement_and_release(run, SECOND_GRACE_CPUS, ALL4, SECOND_GPU);
    assert!(
        !run.stderr().contains("using NVML's CPU affinity"),
        "configure(1) fell back to NVML:\n{}",
        run.stderr()
    );
    workers_pages_all_on(run, SECOND_GRACE_NODE);
}

/// The GPU's `numa_node` is -1 (QEMU's own device tree; a DGX Spark's GPU is so): NVML's CPU
/// affinity (node 1's CPUs) decides, for `configure(0)` and `plan --gpu 0` alike.
#[test]
fn a_gpu_without_a_numa_node_gets_nvmls_cpu_affinity() {
    let guest = require!(no_node());
    let pci = guest.ok("pci");
    println!(
        "tier: {} booted in {:.0} s",
        guest.machine,
        guest.wall.as_secs_f64()
    );
    assert_eq!(
        pci.out,
        ["-1", ALL4],
        "{GUEST_GPU}'s numa_node and local_cpulist"
    );
    let run = guest.ok("placement");
    println!("{}\n{}", run.text(), run.stderr());
    assert_eq!(
        run.mask("configured", "W"),
        (GRACE_CPUS.to_string(), Some(1)),
        "{}",
        run.stderr()
    );
    assert_eq!(run.mask("configured", "H").0, ALL4);
    assert_eq!(run.mask("released", "W").0, ALL4);
    let plan = guest.ok("plan").json();
    assert_eq!(plan["worker"]["cpus"], GRACE_CPUS, "{plan}");
}
