//! Who a thread is, as every layer names it: its kernel id, its role and who chose its mask
//! (SPEC §2). The registry keeps these per thread, the thread table encodes them for
//! `tllm-affinity ps`, and the report prints them; none of those needs the others to name them.

use serde::Serialize;

/// A kernel thread id (0 names the calling thread where a syscall takes one).
pub type Tid = i32;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Host,
    Worker,
}

/// Who chose a thread's current mask (SPEC §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    Inherited,
    Worker,
    Step,
    Result,
    Explicit,
    External,
}

impl Placement {
    /// Masks the library chose, and so must put back.
    pub fn set_by_library(self) -> bool {
        matches!(
            self,
            Placement::Worker | Placement::Step | Placement::Result
        )
    }

    /// Masks somebody else chose, which the library never overrides.
    pub fn chosen_by_others(self) -> bool {
        matches!(self, Placement::Explicit | Placement::External)
    }
}
