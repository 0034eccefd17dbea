//! NVML, loaded with `dlopen` at the first `configure`, `plan` or `topo` (SPEC §4): the GPUs of
//! *this* process (a container's, not the host's), with their PCI bus ids, UUIDs, MIG instances,
//! NVML's CPU affinity and the NUMA node holding each GPU's memory.
//!
//! This is the only place that calls NVML, and the only `unsafe` outside the engine: `dlopen`,
//! `dlsym` and the calls through the resolved pointers. Everything is copied into plain data
//! ([`NvmlGpu`]) and NVML is shut down before [`query`] returns, so nothing of NVML's outlives
//! the call (a fork child reuses the data, never a handle). The prototypes and layouts are those
//! of `nvml.h` (NVML 12.x); a driver missing a required entry point counts as "no NVML".

use crate::mask::CpuMask;
use std::ffi::{c_char, c_int, c_uint, c_ulong, c_void, CStr};

/// One GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlGpu {
    /// NVML's `busId`, as written (`00000000:3B:00.0`).
    pub bus_id: String,
    /// `GPU-8f3c...`.
    pub uuid: String,
    /// The UUIDs of the GPU's MIG instances (`MIG-...`), empty when MIG is off or unsupported.
    pub migs: Vec<String>,
    /// `nvmlDeviceGetCpuAffinityWithinScope(NODE)` (else `nvmlDeviceGetCpuAffinity`), when it
    /// answers.
    pub cpus: Option<CpuMask>,
    /// `nvmlDeviceGetNumaNodeId`: the NUMA node holding the GPU's memory (a CPU-less node on
    /// GB200, GB300 and GH200 in NUMA mode), or that the driver onlines none.
    pub numa_node: NvmlMemoryNode,
}

/// What `nvmlDeviceGetNumaNodeId` said of a GPU's memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NvmlMemoryNode {
    /// This NUMA node holds it.
    Node(usize),
    /// NOT_SUPPORTED: the driver onlines no NUMA node for it (CDMM mode, or a GPU whose memory
    /// never is a node, as on x86).
    NotSupported,
    /// Not asked, the call is missing, or it failed otherwise.
    #[default]
    Unknown,
}

impl NvmlMemoryNode {
    /// The node, when NVML named one.
    pub fn node(self) -> Option<usize> {
        match self {
            NvmlMemoryNode::Node(n) => Some(n),
            NvmlMemoryNode::NotSupported | NvmlMemoryNode::Unknown => None,
        }
    }
}

/// The library name the CUDA runtime and pynvml load.
pub const LIBRARY: &str = "libnvidia-ml.so.1";

// Return codes and sizes from nvml.h.
const NVML_SUCCESS: c_int = 0;
const NVML_ERROR_NOT_SUPPORTED: c_int = 3;
const NVML_AFFINITY_SCOPE_NODE: c_uint = 0;
const NVML_DEVICE_UUID_V2_BUFFER_SIZE: usize = 96;
const NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE: usize = 32;
const NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE: usize = 16;

type Device = *mut c_void;

/// `nvmlPciInfo_t` (the layout `nvmlDeviceGetPciInfo_v3` fills).
#[repr(C)]
struct PciInfo {
    bus_id_legacy: [c_char; NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    bus_id: [c_char; NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE],
}

// The size nvml.h gives the struct: 16 + 5 * 4 + 32.
const _: () = assert!(std::mem::size_of::<PciInfo>() == 68);

type InitFn = unsafe extern "C" fn() -> c_int;
type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
type CountFn = unsafe extern "C" fn(*mut c_uint) -> c_int;
type HandleByIndexFn = unsafe extern "C" fn(c_uint, *mut Device) -> c_int;
type PciInfoFn = unsafe extern "C" fn(Device, *mut PciInfo) -> c_int;
type UuidFn = unsafe extern "C" fn(Device, *mut c_char, c_uint) -> c_int;
type AffinityScopeFn = unsafe extern "C" fn(Device, c_uint, *mut c_ulong, c_uint) -> c_int;
type AffinityFn = unsafe extern "C" fn(Device, c_uint, *mut c_ulong) -> c_int;
type IsMigFn = unsafe extern "C" fn(Device, *mut c_uint) -> c_int;
type MigParentFn = unsafe extern "C" fn(Device, *mut Device) -> c_int;
type MigByIndexFn = unsafe extern "C" fn(Device, c_uint, *mut Device) -> c_int;
type MaxMigFn = unsafe extern "C" fn(Device, *mut c_uint) -> c_int;
type NumaNodeFn = unsafe extern "C" fn(Device, *mut c_uint) -> c_int;

/// Declares [`Api`] and its loader from one list: each entry point is named once, with its
/// field, the field's type (its prototype, in an `Option` for an optional one) and its C name.
macro_rules! entry_points {
    (
        required { $($req:ident: $req_ty:ty = $req_name:literal,)* }
        optional { $($opt:ident: Option<$opt_ty:ty> = $opt_name:literal,)* }
    ) => {
        /// The entry points used. The required ones must all resolve; a driver without the MIG
        /// ones has no MIG (names then fail to resolve, with a warning), one without either
        /// affinity call leaves the CPUs to sysfs, one without the NUMA node call (before NVML
        /// 12) leaves the GPU's memory node to the driver's `numa_status`.
        struct Api {
            $($req: $req_ty,)*
            $($opt: Option<$opt_ty>,)*
        }

        impl Api {
            /// Every entry point from `lib`; `Err` names the first required one missing.
            ///
            /// # Safety
            /// `lib` is a live `dlopen` handle of NVML.
            unsafe fn from_library(lib: *mut c_void) -> Result<Api, String> {
                Ok(Api {
                    $($req: {
                        // SAFETY: `lib` is live (the contract); the type is nvml.h's prototype
                        // for the name.
                        let found = unsafe { symbol::<$req_ty>(lib, $req_name) };
                        found.ok_or_else(|| {
                            format!("{LIBRARY} has no {}", $req_name.to_str().unwrap_or_default())
                        })?
                    },)*
                    // SAFETY: as for the required ones.
                    $($opt: unsafe { symbol::<$opt_ty>(lib, $opt_name) },)*
                })
            }
        }
    };
}

entry_points! {
    required {
        init: InitFn = c"nvmlInit_v2",
        shutdown: InitFn = c"nvmlShutdown",
        error_string: ErrorStringFn = c"nvmlErrorString",
        count: CountFn = c"nvmlDeviceGetCount_v2",
        handle_by_index: HandleByIndexFn = c"nvmlDeviceGetHandleByIndex_v2",
        pci_info: PciInfoFn = c"nvmlDeviceGetPciInfo_v3",
        uuid: UuidFn = c"nvmlDeviceGetUUID",
    }
    optional {
        affinity_scope: Option<AffinityScopeFn> = c"nvmlDeviceGetCpuAffinityWithinScope",
        affinity: Option<AffinityFn> = c"nvmlDeviceGetCpuAffinity",
        is_mig: Option<IsMigFn> = c"nvmlDeviceIsMigDeviceHandle",
        mig_parent: Option<MigParentFn> = c"nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        mig_by_index: Option<MigByIndexFn> = c"nvmlDeviceGetMigDeviceHandleByIndex",
        max_mig: Option<MaxMigFn> = c"nvmlDeviceGetMaxMigDeviceCount",
        numa_node: Option<NumaNodeFn> = c"nvmlDeviceGetNumaNodeId",
    }
}

/// `dlsym(lib, name)` as a function pointer of type `F`, or `None`.
///
/// # Safety
/// `lib` is a live `dlopen` handle and `F` is the C prototype nvml.h declares for `name`.
unsafe fn symbol<F: Copy>(lib: *mut c_void, name: &CStr) -> Option<F> {
    // SAFETY: per the contract `lib` is live; `name` is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
    if p.is_null() {
        return None;
    }
    debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: `F` is a function pointer type of the symbol's prototype (the contract), and a
    // data pointer from dlsym has the same size and representation on Linux.
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

fn dlerror_text() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call on
    // this thread, copied at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        return "unknown error".to_string();
    }
    // SAFETY: non-NULL, NUL-terminated (above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// [`resolve`], then glibc's dlerror state freed: a failed `dlopen` or a missing optional symbol
/// leaves a buffer in the calling thread, lost when that thread ends (memcheck's "definitely
/// lost" under `_dlerror_run`, seen in tests/memcheck.rs's fork case).
fn load() -> Result<Api, String> {
    let api = resolve();
    // The first call hands out any pending message, the second frees it (glibc 2.34+; older
    // glibc frees at the next dl* call, so this is harmless there).
    for _ in 0..2 {
        // SAFETY: dlerror has no preconditions; its result is not used.
        let _ = unsafe { libc::dlerror() };
    }
    api
}

fn resolve() -> Result<Api, String> {
    let name = c"libnvidia-ml.so.1";
    // SAFETY: dlopen with a NUL-terminated name; the handle is kept for the life of the process
    // (never dlclose'd: NVML may have registered handlers that must stay mapped).
    let lib = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if lib.is_null() {
        return Err(format!("{LIBRARY} does not load: {}", dlerror_text()));
    }
    // SAFETY: `lib` was just returned by dlopen and is never closed.
    unsafe { Api::from_library(lib) }
}

/// A NUL-terminated C string in a fixed buffer; up to the end when NVML wrote no NUL.
fn buffer_text(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

impl Api {
    fn error(&self, call: &str, rc: c_int) -> String {
        // SAFETY: nvmlErrorString accepts any code and returns NULL or a static string.
        let p = unsafe { (self.error_string)(rc) };
        let text = if p.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: non-NULL, NUL-terminated, static (nvml.h).
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        format!("{call} returned {rc} ({text})")
    }

    fn check(&self, call: &str, rc: c_int) -> Result<(), String> {
        if rc == NVML_SUCCESS {
            Ok(())
        } else {
            Err(self.error(call, rc))
        }
    }

    fn uuid_of(&self, device: Device) -> Result<String, String> {
        let mut buf = [0 as c_char; NVML_DEVICE_UUID_V2_BUFFER_SIZE];
        // SAFETY: `device` is a non-NULL handle NVML returned; the buffer holds `len` bytes.
        let rc = unsafe { (self.uuid)(device, buf.as_mut_ptr(), buf.len() as c_uint) };
        self.check("nvmlDeviceGetUUID", rc)?;
        let uuid = buffer_text(&buf);
        if uuid.is_empty() {
            return Err("nvmlDeviceGetUUID returned an empty UUID".to_string());
        }
        Ok(uuid)
    }

    fn device(&self, index: c_uint) -> Result<NvmlGpu, String> {
        let mut device: Device = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local.
        let rc = unsafe { (self.handle_by_index)(index, &mut device) };
        self.check(&format!("nvmlDeviceGetHandleByIndex_v2({index})"), rc)?;
        if device.is_null() {
            return Err(format!(
                "nvmlDeviceGetHandleByIndex_v2({index}) returned a NULL handle"
            ));
        }
        // SAFETY: PciInfo is plain C data; all-zero is a valid value.
        let mut pci: PciInfo = unsafe { std::mem::zeroed() };
        // SAFETY: a non-NULL handle and an out-pointer to a struct of nvml.h's layout.
        let rc = unsafe { (self.pci_info)(device, &mut pci) };
        self.check("nvmlDeviceGetPciInfo_v3", rc)?;
        let mut bus_id = buffer_text(&pci.bus_id);
        if bus_id.is_empty() {
            bus_id = buffer_text(&pci.bus_id_legacy);
        }
        if bus_id.is_empty() {
            // Old drivers fill only the numbers.
            bus_id = format!("{:08x}:{:02x}:{:02x}.0", pci.domain, pci.bus, pci.device);
        }
        Ok(NvmlGpu {
            bus_id,
            uuid: self.uuid_of(device)?,
            migs: self.migs(device),
            cpus: self.cpus(device),
            numa_node: self.numa_node(device),
        })
    }

    /// The node holding the GPU's memory, NOT_SUPPORTED where the driver onlines none, else
    /// unknown (the call missing or failing otherwise).
    fn numa_node(&self, device: Device) -> NvmlMemoryNode {
        let Some(f) = self.numa_node else {
            return NvmlMemoryNode::Unknown;
        };
        let mut node: c_uint = 0;
        // SAFETY: a non-NULL handle and an out-pointer to a local.
        let rc = unsafe { f(device, &mut node) };
        match rc {
            // No kernel numbers a node past MAX_CPU; a larger value is no node (an all-ones -1).
            NVML_SUCCESS if node as usize <= crate::mask::MAX_CPU => {
                NvmlMemoryNode::Node(node as usize)
            }
            NVML_ERROR_NOT_SUPPORTED => NvmlMemoryNode::NotSupported,
            _ => NvmlMemoryNode::Unknown,
        }
    }

    /// NVML's CPU affinity: the node scope where the driver has it, as SPEC §4 asks.
    fn cpus(&self, device: Device) -> Option<CpuMask> {
        // SAFETY: sysconf has no preconditions.
        let configured = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) }.max(1) as usize;
        let bits = c_ulong::BITS as usize;
        let words = (configured.div_ceil(bits)).max(1024 / bits);
        let mut set: Vec<c_ulong> = vec![0; words];
        let rc = if let Some(f) = self.affinity_scope {
            // SAFETY: a non-NULL handle and a buffer of `words` elements.
            unsafe {
                f(
                    device,
                    words as c_uint,
                    set.as_mut_ptr(),
                    NVML_AFFINITY_SCOPE_NODE,
                )
            }
        } else if let Some(f) = self.affinity {
            // SAFETY: as above.
            unsafe { f(device, words as c_uint, set.as_mut_ptr()) }
        } else {
            return None;
        };
        if rc != NVML_SUCCESS {
            return None;
        }
        let cpus = set.iter().enumerate().flat_map(|(w, &word)| {
            (0..bits)
                .filter(move |b| word >> b & 1 == 1)
                .map(move |b| w * bits + b)
        });
        Some(CpuMask::from_cpus(cpus)).filter(|m| !m.is_empty())
    }

    /// The UUIDs of `device`'s MIG instances; any error means none.
    fn migs(&self, device: Device) -> Vec<String> {
        let (Some(max_mig), Some(by_index)) = (self.max_mig, self.mig_by_index) else {
            return Vec::new();
        };
        let mut max: c_uint = 0;
        // SAFETY: a non-NULL handle and an out-pointer to a local.
        if unsafe { max_mig(device, &mut max) } != NVML_SUCCESS {
            return Vec::new();
        }
        let mut migs = Vec::new();
        for i in 0..max.min(64) {
            let mut mig: Device = std::ptr::null_mut();
            // SAFETY: as above; NOT_FOUND for an unused slot.
            if unsafe { by_index(device, i, &mut mig) } != NVML_SUCCESS || mig.is_null() {
                continue;
            }
            if let Some(is_mig) = self.is_mig {
                let mut flag: c_uint = 0;
                // SAFETY: a non-NULL handle and an out-pointer to a local.
                if unsafe { is_mig(mig, &mut flag) } != NVML_SUCCESS || flag == 0 {
                    continue;
                }
            }
            if let Some(parent_of) = self.mig_parent {
                let mut parent: Device = std::ptr::null_mut();
                // SAFETY: as above. A MIG handle whose parent is another GPU is not this one's.
                let rc = unsafe { parent_of(mig, &mut parent) };
                if rc != NVML_SUCCESS || parent != device {
                    continue;
                }
            }
            if let Ok(uuid) = self.uuid_of(mig) {
                migs.push(uuid);
            }
        }
        migs
    }
}

/// Why NVML's answer cannot be used: one line, and whether NVML had initialised. An NVML that
/// is not there to ask (no library, an entry point missing, `nvmlInit_v2` failing: a host or
/// container without the NVIDIA driver) is routine; one that initialised and counted devices
/// but cannot give every device's PCI address (an error code, a NULL handle: a driver and
/// library mismatch, a GPU fallen off the bus, device nodes not all mounted) is worth a warning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unusable {
    pub reason: String,
    pub initialised: bool,
}

impl Unusable {
    fn absent(reason: String) -> Unusable {
        Unusable {
            reason,
            initialised: false,
        }
    }
}

/// Loads and initialises NVML, lists its GPUs in NVML's order, and shuts it down. `Err` says
/// why NVML cannot be used: the caller falls back to the driver's list and sysfs.
pub fn query() -> Result<Vec<NvmlGpu>, Unusable> {
    let api = load().map_err(Unusable::absent)?;
    // SAFETY: nvmlInit_v2 takes no arguments and may be called from any thread.
    let rc = unsafe { (api.init)() };
    if rc != NVML_SUCCESS {
        return Err(Unusable::absent(api.error("nvmlInit_v2", rc)));
    }
    let listed: Result<Vec<NvmlGpu>, String> = (|| {
        let mut count: c_uint = 0;
        // SAFETY: an out-pointer to a local.
        let rc = unsafe { (api.count)(&mut count) };
        api.check("nvmlDeviceGetCount_v2", rc)?;
        (0..count.min(1024)).map(|i| api.device(i)).collect()
    })();
    // SAFETY: balances the successful nvmlInit_v2 above (NVML counts references).
    unsafe { (api.shutdown)() };
    listed.map_err(|reason| Unusable {
        reason,
        initialised: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_stop_at_the_nul() {
        let mut buf = [0 as c_char; 8];
        for (i, b) in b"ab c".iter().enumerate() {
            buf[i] = *b as c_char;
        }
        assert_eq!(buffer_text(&buf), "ab c");
        let full = [b'x' as c_char; 4];
        assert_eq!(buffer_text(&full), "xxxx");
    }
}
