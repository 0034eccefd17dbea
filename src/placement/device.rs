//! CUDA logical device → host GPU (SPEC §4).
//!
//! A CUDA device number is an index into the GPUs the CUDA runtime makes visible, which
//! `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER` decide. This module reproduces that mapping
//! from the environment and the PCI-ordered GPU list of [`crate::host::gpus`] (NVML's, the driver's or
//! sysfs's), without loading CUDA. UUIDs resolve where the list has them (NVML, the driver's
//! list), MIG names where it has MIG instances (NVML).

#![forbid(unsafe_code)]

use crate::host::gpus::{GpuSource, GpuView, HostGpu};
use crate::host::topology::{PciGpu, SysfsRoot};
use crate::placement::settings::{parse_gpu, parse_index, GpuChoice, GPU_EXPECTED};
use std::fmt;

/// The launcher variables holding the process's local rank, in the order they are consulted.
pub const LOCAL_RANK_VARS: [&str; 5] = [
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
    "LOCAL_RANK",
];

/// The variables that decide which GPU a device number means.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceEnv {
    pub cuda_visible_devices: Option<String>,
    pub cuda_device_order: Option<String>,
    pub tllm_affinity_gpu: Option<String>,
    /// The first set (non-empty) of [`LOCAL_RANK_VARS`], with its name.
    pub local_rank: Option<(&'static str, String)>,
}

impl DeviceEnv {
    pub fn from_env() -> Self {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Builds the environment from `lookup(name)` (tests pass a map).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Self {
        Self {
            cuda_visible_devices: lookup("CUDA_VISIBLE_DEVICES"),
            cuda_device_order: lookup("CUDA_DEVICE_ORDER"),
            tllm_affinity_gpu: lookup("TLLM_AFFINITY_GPU"),
            local_rank: LOCAL_RANK_VARS.iter().find_map(|&name| {
                lookup(name)
                    .filter(|v| !v.trim().is_empty())
                    .map(|v| (name, v))
            }),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedDevice {
    /// Index into the PCI-ordered GPU list given.
    pub gpu_index: usize,
    pub address: String,
    /// How the answer was reached, for the log line.
    pub how: String,
}

/// A device that cannot be resolved: one line naming the variable, its value and what was
/// expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceError {
    pub message: String,
}

impl DeviceError {
    fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DeviceError {}

/// [`resolve_device_in`] for GPUs read from the default sysfs root `/`.
pub fn resolve_device(
    device_id: i32,
    env: &DeviceEnv,
    gpus: &[PciGpu],
) -> Result<ResolvedDevice, DeviceError> {
    resolve_device_in(device_id, env, gpus, &SysfsRoot::default())
}

/// [`resolve_device_on`] for sysfs's GPU list read under `root`.
pub fn resolve_device_in(
    device_id: i32,
    env: &DeviceEnv,
    gpus: &[PciGpu],
    root: &SysfsRoot,
) -> Result<ResolvedDevice, DeviceError> {
    let list = Listed {
        gpus: gpus.iter().map(HostGpu::from_pci).collect(),
        source: GpuSource::Sysfs,
    };
    resolve(device_id, env, &list, root)
}

/// Maps `device_id` to one of `view.gpus` (PCI order); `root` is where they were read, only named
/// in the error when there are none.
///
/// - `device_id >= 0`: a CUDA device number, an index into the visible GPUs.
/// - `-1`: `TLLM_AFFINITY_GPU` (a CUDA device number, or a PCI address that bypasses
///   visibility), else the local rank modulo the number of visible GPUs, else device 0.
pub fn resolve_device_on(
    device_id: i32,
    env: &DeviceEnv,
    view: &GpuView,
    root: &SysfsRoot,
) -> Result<ResolvedDevice, DeviceError> {
    let list = Listed {
        gpus: view.gpus.clone(),
        source: view.source,
    };
    resolve(device_id, env, &list, root)
}

/// The GPUs CUDA can number and the source that listed them (which names they resolve).
struct Listed {
    gpus: Vec<HostGpu>,
    source: GpuSource,
}

fn resolve(
    device_id: i32,
    env: &DeviceEnv,
    list: &Listed,
    root: &SysfsRoot,
) -> Result<ResolvedDevice, DeviceError> {
    if device_id < -1 {
        return Err(DeviceError::new(format!(
            "device id {device_id} is not valid: expected a CUDA device number (0, 1, ...) or -1 \
             (TLLM_AFFINITY_GPU, else the local rank)"
        )));
    }
    if list.gpus.is_empty() {
        return Err(DeviceError::new(match list.source {
            GpuSource::Sysfs => format!(
                "no GPU found under {}",
                root.path("sys/bus/pci/devices").display()
            ),
            GpuSource::Nvml => "NVML shows no GPU".to_string(),
            GpuSource::DriverList => format!(
                "no GPU of the driver's list under {} may be opened by this process (its \
                 /dev/nvidia<minor> does not open)",
                root.path("proc/driver/nvidia/gpus").display()
            ),
        }));
    }
    if let Ok(index) = usize::try_from(device_id) {
        return by_cuda_index(index, env, list, String::new());
    }

    if let Some(value) = env
        .tllm_affinity_gpu
        .as_deref()
        .filter(|v| !v.trim().is_empty())
    {
        return match parse_gpu(value) {
            Ok(Some(GpuChoice::Index(index))) => by_cuda_index(
                index,
                env,
                list,
                format!("TLLM_AFFINITY_GPU={}: ", value.trim()),
            ),
            Ok(Some(GpuChoice::Address(wanted))) => by_address(value, &wanted, &list.gpus),
            // Refused at load already; seen here only when the program set it since.
            Ok(None) | Err(_) => Err(DeviceError::new(format!(
                "TLLM_AFFINITY_GPU='{value}': expected {GPU_EXPECTED}"
            ))),
        };
    }

    if let Some((name, value)) = &env.local_rank {
        let Some(rank) = parse_index(value.trim()) else {
            return Err(DeviceError::new(format!(
                "{name}='{value}': expected a local rank (a non-negative integer)"
            )));
        };
        let visible = visible_in(env, list)?;
        if visible.is_empty() {
            return Err(no_visible_gpu(env));
        }
        let index = rank % visible.len();
        let prefix = format!(
            "local rank {rank} ({name}) mod {} visible GPU(s): ",
            visible.len()
        );
        return by_cuda_index(index, env, list, prefix);
    }

    by_cuda_index(
        0,
        env,
        list,
        "no device given, TLLM_AFFINITY_GPU and local rank unset: ".to_string(),
    )
}

/// The GPUs CUDA makes visible, as indices into `gpus` (sysfs's list), in CUDA device order.
pub fn visible_gpus(env: &DeviceEnv, gpus: &[PciGpu]) -> Result<Vec<usize>, DeviceError> {
    let list = Listed {
        gpus: gpus.iter().map(HostGpu::from_pci).collect(),
        source: GpuSource::Sysfs,
    };
    visible_in(env, &list)
}

/// The GPUs of `view` CUDA makes visible, as indices into `view.gpus`, in CUDA device order.
pub fn visible_in_view(env: &DeviceEnv, view: &GpuView) -> Result<Vec<usize>, DeviceError> {
    let list = Listed {
        gpus: view.gpus.clone(),
        source: view.source,
    };
    visible_in(env, &list)
}

/// `CUDA_DEVICE_ORDER=FASTEST_FIRST` (CUDA's default) cannot be ranked without CUDA; it is taken
/// as PCI order, which is what CUDA gives on the identical GPUs of an inference server.
/// `CUDA_VISIBLE_DEVICES` follows the CUDA runtime: entries are read up to the first invalid one
/// (not an index, out of range, an unknown or ambiguous UUID, or repeated), and an empty value
/// hides every GPU. Each MIG instance is a device of its own, on its parent GPU.
fn visible_in(env: &DeviceEnv, list: &Listed) -> Result<Vec<usize>, DeviceError> {
    match env.cuda_device_order.as_deref().map(str::trim) {
        None | Some("") | Some("PCI_BUS_ID") | Some("FASTEST_FIRST") => {}
        Some(_) => {
            return Err(DeviceError::new(format!(
                "CUDA_DEVICE_ORDER='{}': expected PCI_BUS_ID or FASTEST_FIRST",
                env.cuda_device_order.as_deref().unwrap_or_default()
            )))
        }
    }
    let Some(value) = env.cuda_visible_devices.as_deref() else {
        return Ok((0..list.gpus.len()).collect());
    };
    let mut visible = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    for entry in value.split(',').map(str::trim) {
        let Some((index, key)) = entry_gpu(entry, value, list)? else {
            break;
        };
        if seen.contains(&key) {
            break;
        }
        seen.push(key);
        visible.push(index);
    }
    Ok(visible)
}

/// The GPU one `CUDA_VISIBLE_DEVICES` entry names, with a key for spotting repeats; `None` for an
/// entry CUDA would take as invalid.
fn entry_gpu(
    entry: &str,
    value: &str,
    list: &Listed,
) -> Result<Option<(usize, String)>, DeviceError> {
    let lower = entry.to_ascii_lowercase();
    let gpus = &list.gpus;
    if let Some(mig) = lower.strip_prefix("mig-") {
        if list.source != GpuSource::Nvml {
            return Err(DeviceError::new(format!(
                "CUDA_VISIBLE_DEVICES='{value}': '{entry}' is a MIG name; mapping it to its GPU \
                 needs NVML, which is not available ({} lists the GPUs); use device indices or \
                 set TLLM_AFFINITY_GPU to the PCI address",
                list.source
            )));
        }
        // `MIG-GPU-<uuid>/<gi>/<ci>` (drivers before R470) names the parent GPU's UUID.
        if let Some((parent, _instance)) = mig.split_once('/') {
            let found = gpus.iter().position(|g| {
                g.uuid
                    .as_deref()
                    .is_some_and(|u| u.eq_ignore_ascii_case(parent))
            });
            return Ok(found.map(|i| (i, lower.clone())));
        }
        let found = unique(gpus.iter().enumerate().filter(|(_, g)| {
            g.migs
                .iter()
                .any(|m| m.to_ascii_lowercase().starts_with(&lower))
        }));
        return Ok(found.map(|i| (i, lower.clone())));
    }
    if lower.starts_with("gpu-") {
        if list.source == GpuSource::Sysfs {
            return Err(DeviceError::new(format!(
                "CUDA_VISIBLE_DEVICES='{value}': '{entry}' is a GPU UUID; mapping it to a PCI \
                 address needs NVML or the driver's list (/proc/driver/nvidia/gpus), which are \
                 not available; use device indices or set TLLM_AFFINITY_GPU to the PCI address"
            )));
        }
        // CUDA accepts any prefix that names one GPU.
        let found = unique(gpus.iter().enumerate().filter(|(_, g)| {
            g.uuid
                .as_deref()
                .is_some_and(|u| u.to_ascii_lowercase().starts_with(&lower))
        }));
        return Ok(found.map(|i| (i, format!("gpu {i}"))));
    }
    Ok(parse_index(entry)
        .filter(|&i| i < gpus.len())
        .map(|i| (i, format!("gpu {i}"))))
}

/// The index of the only match, `None` for none or several.
fn unique<'a>(mut matches: impl Iterator<Item = (usize, &'a HostGpu)>) -> Option<usize> {
    let (first, _) = matches.next()?;
    matches.next().is_none().then_some(first)
}

fn by_cuda_index(
    index: usize,
    env: &DeviceEnv,
    list: &Listed,
    prefix: String,
) -> Result<ResolvedDevice, DeviceError> {
    let visible = visible_in(env, list)?;
    let Some(&gpu_index) = visible.get(index) else {
        if visible.is_empty() {
            return Err(no_visible_gpu(env));
        }
        let why = match &env.cuda_visible_devices {
            Some(v) => format!("CUDA_VISIBLE_DEVICES='{v}' makes {} visible", visible.len()),
            None => format!("{} found, CUDA_VISIBLE_DEVICES unset", list.gpus.len()),
        };
        return Err(DeviceError::new(format!(
            "{prefix}CUDA device {index} does not exist: expected 0..{} ({why})",
            visible.len() - 1
        )));
    };
    let address = list.gpus[gpu_index].address.clone();
    let from = match list.source {
        GpuSource::Sysfs => String::new(),
        source => format!(", from {source}"),
    };
    let how = match &env.cuda_visible_devices {
        Some(_) => format!(
            "{prefix}CUDA device {index} = CUDA_VISIBLE_DEVICES[{index}] = GPU {gpu_index} ({address}){from}"
        ),
        None => format!(
            "{prefix}CUDA device {index} = GPU {gpu_index} ({address}) in PCI order{from}"
        ),
    };
    Ok(ResolvedDevice {
        gpu_index,
        address,
        how,
    })
}

/// `wanted`: `value`, normalised by [`parse_gpu`].
fn by_address(value: &str, wanted: &str, gpus: &[HostGpu]) -> Result<ResolvedDevice, DeviceError> {
    let Some(gpu_index) = gpus.iter().position(|g| g.address == wanted) else {
        let found: Vec<&str> = gpus.iter().map(|g| g.address.as_str()).collect();
        return Err(DeviceError::new(format!(
            "TLLM_AFFINITY_GPU='{value}': no GPU at that PCI address; expected one of {}",
            found.join(", ")
        )));
    };
    Ok(ResolvedDevice {
        gpu_index,
        how: format!(
            "TLLM_AFFINITY_GPU={} = GPU {gpu_index} ({wanted})",
            value.trim()
        ),
        address: wanted.to_string(),
    })
}

fn no_visible_gpu(env: &DeviceEnv) -> DeviceError {
    DeviceError::new(format!(
        "no GPU is visible: CUDA_VISIBLE_DEVICES='{}' names no GPU of this host; expected \
         comma-separated device indices or GPU UUIDs",
        env.cuda_visible_devices.as_deref().unwrap_or_default()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn gpus(addresses: &[&str]) -> Vec<PciGpu> {
        addresses
            .iter()
            .map(|a| PciGpu {
                address: a.to_string(),
                vendor: 0x10de,
                device: 0x2330,
                class: 0x030200,
                numa_node: None,
                local_cpus: None,
            })
            .collect()
    }

    fn four() -> Vec<PciGpu> {
        gpus(&[
            "0000:18:00.0",
            "0000:3b:00.0",
            "0000:86:00.0",
            "0000:b1:00.0",
        ])
    }

    fn env(vars: &[(&str, &str)]) -> DeviceEnv {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DeviceEnv::from_lookup(|name| map.get(name).cloned())
    }

    fn resolve(id: i32, vars: &[(&str, &str)]) -> Result<ResolvedDevice, DeviceError> {
        resolve_device(id, &env(vars), &four())
    }

    fn addr(id: i32, vars: &[(&str, &str)]) -> String {
        resolve(id, vars).unwrap().address
    }

    fn err(id: i32, vars: &[(&str, &str)]) -> String {
        resolve(id, vars).unwrap_err().message
    }

    #[test]
    fn env_lookup_takes_the_first_local_rank_variable() {
        let e = env(&[
            ("SLURM_LOCALID", "3"),
            ("LOCAL_RANK", "1"),
            ("MPI_LOCALRANKID", ""),
        ]);
        assert_eq!(e.local_rank, Some(("SLURM_LOCALID", "3".to_string())));
        let e = env(&[("LOCAL_RANK", "1"), ("OMPI_COMM_WORLD_LOCAL_RANK", "2")]);
        assert_eq!(
            e.local_rank,
            Some(("OMPI_COMM_WORLD_LOCAL_RANK", "2".to_string()))
        );
        assert_eq!(env(&[]), DeviceEnv::default());
        // The process environment is read without panicking whatever it holds.
        let _ = DeviceEnv::from_env();
    }

    #[test]
    fn unset_visibility_is_pci_order() {
        assert_eq!(addr(0, &[]), "0000:18:00.0");
        let r = resolve(3, &[]).unwrap();
        assert_eq!(r.gpu_index, 3);
        assert_eq!(r.how, "CUDA device 3 = GPU 3 (0000:b1:00.0) in PCI order");
    }

    #[test]
    fn visible_devices_remap_indices() {
        let r = resolve(1, &[("CUDA_VISIBLE_DEVICES", "2,3")]).unwrap();
        assert_eq!(r.gpu_index, 3);
        assert_eq!(
            r.how,
            "CUDA device 1 = CUDA_VISIBLE_DEVICES[1] = GPU 3 (0000:b1:00.0)"
        );
        assert_eq!(
            addr(0, &[("CUDA_VISIBLE_DEVICES", " 2 , 0 ")]),
            "0000:86:00.0"
        );
        assert_eq!(
            addr(1, &[("CUDA_VISIBLE_DEVICES", " 2 , 0 ")]),
            "0000:18:00.0"
        );
    }

    #[test]
    fn visible_devices_stop_at_the_first_invalid_entry() {
        let vis = |v: &str| visible_gpus(&env(&[("CUDA_VISIBLE_DEVICES", v)]), &four()).unwrap();
        assert_eq!(vis("0,2,-1,1"), vec![0, 2]);
        assert_eq!(vis("1,7,2"), vec![1]);
        assert_eq!(vis("1,1,2"), vec![1]);
        assert_eq!(vis("3,x,0"), vec![3]);
        assert_eq!(vis("-1"), Vec::<usize>::new());
        // A UUID after the cut is never read.
        assert_eq!(vis("0,-1,GPU-abc"), vec![0]);
        let e = err(2, &[("CUDA_VISIBLE_DEVICES", "1,7,2")]);
        assert!(e.contains("CUDA device 2 does not exist"), "{e}");
        assert!(
            e.contains("CUDA_VISIBLE_DEVICES='1,7,2' makes 1 visible"),
            "{e}"
        );
    }

    #[test]
    fn empty_visible_devices_hide_every_gpu() {
        let e = err(0, &[("CUDA_VISIBLE_DEVICES", "")]);
        assert!(
            e.starts_with("no GPU is visible: CUDA_VISIBLE_DEVICES=''"),
            "{e}"
        );
        let e = err(-1, &[("CUDA_VISIBLE_DEVICES", ""), ("LOCAL_RANK", "0")]);
        assert!(e.starts_with("no GPU is visible"), "{e}");
    }

    #[test]
    fn uuid_and_mig_names_need_nvml() {
        for value in [
            "GPU-5f3e1c2a-0000-1111-2222-333344445555",
            "0,MIG-GPU-abc/1/0",
        ] {
            let e = err(0, &[("CUDA_VISIBLE_DEVICES", value)]);
            assert!(e.contains("CUDA_VISIBLE_DEVICES"), "{e}");
            assert!(e.contains(value), "{e}");
            assert!(e.contains("NVML"), "{e}");
            assert!(e.contains("not available"), "{e}");
        }
    }

    #[test]
    fn device_order() {
        for order in ["PCI_BUS_ID", "FASTEST_FIRST", ""] {
            assert_eq!(addr(1, &[("CUDA_DEVICE_ORDER", order)]), "0000:3b:00.0");
        }
        let e = err(0, &[("CUDA_DEVICE_ORDER", "pci")]);
        assert_eq!(
            e,
            "CUDA_DEVICE_ORDER='pci': expected PCI_BUS_ID or FASTEST_FIRST"
        );
    }

    #[test]
    fn minus_one_uses_tllm_affinity_gpu() {
        let vis = ("CUDA_VISIBLE_DEVICES", "3,2");
        // An index goes through visibility.
        let r = resolve(-1, &[("TLLM_AFFINITY_GPU", "1"), vis]).unwrap();
        assert_eq!(r.address, "0000:86:00.0");
        assert!(
            r.how.starts_with("TLLM_AFFINITY_GPU=1: CUDA device 1"),
            "{}",
            r.how
        );
        // An address bypasses it, in either form, and beats the local rank.
        for value in ["0000:3b:00.0", "3B:00.0"] {
            let r = resolve(
                -1,
                &[("TLLM_AFFINITY_GPU", value), vis, ("LOCAL_RANK", "0")],
            )
            .unwrap();
            assert_eq!((r.gpu_index, r.address.as_str()), (1, "0000:3b:00.0"));
        }
        let e = err(-1, &[("TLLM_AFFINITY_GPU", "3c:00.0")]);
        assert!(e.contains("TLLM_AFFINITY_GPU='3c:00.0'"), "{e}");
        assert!(e.contains("0000:18:00.0, 0000:3b:00.0"), "{e}");
        let e = err(-1, &[("TLLM_AFFINITY_GPU", "first")]);
        assert!(e.starts_with("TLLM_AFFINITY_GPU='first': expected"), "{e}");
        let e = err(-1, &[("TLLM_AFFINITY_GPU", "zz:00.0")]);
        assert!(e.contains("PCI address like 0000:3b:00.0"), "{e}");
    }

    #[test]
    fn minus_one_uses_local_rank_modulo_visible() {
        assert_eq!(addr(-1, &[("SLURM_LOCALID", "5")]), "0000:3b:00.0");
        let r = resolve(
            -1,
            &[
                ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
                ("CUDA_VISIBLE_DEVICES", "2,3"),
            ],
        )
        .unwrap();
        assert_eq!(r.address, "0000:b1:00.0");
        assert_eq!(
            r.how,
            "local rank 3 (OMPI_COMM_WORLD_LOCAL_RANK) mod 2 visible GPU(s): CUDA device 1 = \
             CUDA_VISIBLE_DEVICES[1] = GPU 3 (0000:b1:00.0)"
        );
        let e = err(-1, &[("LOCAL_RANK", "-2")]);
        assert_eq!(
            e,
            "LOCAL_RANK='-2': expected a local rank (a non-negative integer)"
        );
    }

    #[test]
    fn minus_one_defaults_to_device_zero() {
        let r = resolve(-1, &[("CUDA_VISIBLE_DEVICES", "2")]).unwrap();
        assert_eq!(r.address, "0000:86:00.0");
        assert!(r.how.starts_with("no device given"), "{}", r.how);
    }

    #[test]
    fn bad_device_ids() {
        let e = err(-2, &[]);
        assert!(e.starts_with("device id -2 is not valid"), "{e}");
        let e = err(4, &[]);
        assert_eq!(
            e,
            "CUDA device 4 does not exist: expected 0..3 (4 found, CUDA_VISIBLE_DEVICES unset)"
        );
    }

    #[test]
    fn no_gpu_names_the_directory() {
        let e = resolve_device(0, &env(&[]), &[]).unwrap_err();
        assert_eq!(e.message, "no GPU found under /sys/bus/pci/devices");
        let root = SysfsRoot::new("/tmp/sim");
        let e = resolve_device_in(-1, &env(&[]), &[], &root).unwrap_err();
        assert_eq!(
            e.to_string(),
            "no GPU found under /tmp/sim/sys/bus/pci/devices"
        );
    }

    const U0: &str = "GPU-8f3c0a1e-1111-2222-3333-444455556666";
    const U1: &str = "GPU-8f3d9b2f-aaaa-bbbb-cccc-ddddeeeeffff";
    const M1: &str = "MIG-5c2a7e44-0123-4567-89ab-cdef01234567";

    /// Two GPUs as NVML (or the driver) lists them: `0000:3b:00.0` with U0, `0000:86:00.0`
    /// with U1 and one MIG instance.
    fn listed(source: GpuSource) -> GpuView {
        let gpu = |address: &str, uuid: &str, migs: &[&str]| HostGpu {
            address: address.to_string(),
            uuid: Some(uuid.to_string()),
            migs: migs.iter().map(|m| m.to_string()).collect(),
            nvml_cpus: None,
            nvml_memory_node: crate::host::nvml::NvmlMemoryNode::Unknown,
        };
        GpuView {
            source,
            gpus: vec![gpu("0000:3b:00.0", U0, &[]), gpu("0000:86:00.0", U1, &[M1])],
            sysfs_count: 8,
            driver: None,
            nvml_error: None,
            nvml_tried: source == GpuSource::Nvml,
        }
    }

    fn on(view: &GpuView, id: i32, vars: &[(&str, &str)]) -> Result<ResolvedDevice, DeviceError> {
        resolve_device_on(id, &env(vars), view, &SysfsRoot::default())
    }

    #[test]
    fn uuids_and_unique_prefixes_resolve_through_nvml_and_the_driver() {
        for source in [GpuSource::Nvml, GpuSource::DriverList] {
            let v = listed(source);
            let a = |id, cvd: &str| {
                on(&v, id, &[("CUDA_VISIBLE_DEVICES", cvd)])
                    .unwrap()
                    .address
            };
            assert_eq!(a(0, U1), "0000:86:00.0");
            assert_eq!(a(0, &U1.to_ascii_lowercase()), "0000:86:00.0");
            assert_eq!(a(1, &format!("{U1},{U0}")), "0000:3b:00.0");
            // "GPU-8f3d" names one GPU; "GPU-8f3" names two, so CUDA stops there.
            assert_eq!(a(0, "GPU-8f3d,0"), "0000:86:00.0");
            let e = on(&v, 0, &[("CUDA_VISIBLE_DEVICES", "GPU-8f3,0")]).unwrap_err();
            assert!(e.message.starts_with("no GPU is visible"), "{e}");
            // A repeated GPU, by index or by UUID, ends the list.
            let vis = visible_in_view(&env(&[("CUDA_VISIBLE_DEVICES", &format!("1,{U1},0"))]), &v);
            assert_eq!(vis.unwrap(), vec![1]);
            let r = on(&v, 0, &[]).unwrap();
            assert!(
                r.how.ends_with(&format!("in PCI order, from {source}")),
                "{}",
                r.how
            );
        }
    }

    #[test]
    fn mig_names_resolve_to_the_parent_gpu_through_nvml() {
        let v = listed(GpuSource::Nvml);
        let a = |id, cvd: &str| {
            on(&v, id, &[("CUDA_VISIBLE_DEVICES", cvd)])
                .unwrap()
                .address
        };
        assert_eq!(a(0, M1), "0000:86:00.0");
        assert_eq!(a(0, "MIG-5c2a7e44"), "0000:86:00.0");
        // The pre-R470 form names the parent's UUID and the instance.
        assert_eq!(a(0, &format!("MIG-{U0}/1/0")), "0000:3b:00.0");
        // Two instances of one GPU are two devices.
        assert_eq!(a(1, &format!("MIG-{U1}/1/0,MIG-{U1}/2/0")), "0000:86:00.0");
        let e = on(&v, 0, &[("CUDA_VISIBLE_DEVICES", "MIG-ffff")]).unwrap_err();
        assert!(e.message.starts_with("no GPU is visible"), "{e}");
    }

    #[test]
    fn mig_names_need_nvml_even_with_the_driver_list() {
        let v = listed(GpuSource::DriverList);
        let e = on(&v, 0, &[("CUDA_VISIBLE_DEVICES", M1)]).unwrap_err();
        assert!(e.message.contains("is a MIG name"), "{e}");
        assert!(
            e.message.contains("needs NVML, which is not available"),
            "{e}"
        );
        assert!(e.message.contains("the driver's list"), "{e}");
    }

    #[test]
    fn an_empty_list_says_which_source_was_empty() {
        let mut v = listed(GpuSource::DriverList);
        v.gpus.clear();
        let e = on(&v, 0, &[]).unwrap_err();
        assert!(e.message.contains("may be opened by this process"), "{e}");
        v.source = GpuSource::Nvml;
        assert_eq!(on(&v, 0, &[]).unwrap_err().message, "NVML shows no GPU");
    }
}
