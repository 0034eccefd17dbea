//! `tllm-affinity ps` without a PID (SPEC §16): the host at a glance. Every process whose thread
//! table the caller may read, containerised ones included (found as `ps PID` finds them, through
//! [`ps::locate`]), one row each: the GPU of each open lease, the CPUs of its workers, step and
//! result threads, its threads by role and its memory per NUMA node; then the host's CPUs grouped
//! by node with the processes on each, as a grid; then what collides, one line each.
//!
//! Each process is read by [`ps::read`], bounded in time and bytes as `ps PID` is; one that
//! cannot be read (a table not believed, a process that exits meanwhile) is one line, never an
//! abort.
//!
//! [`model`] reads and judges (processes, flags, memory: data, no formatting); [`drawing`] turns
//! a [`HostView`] into text or JSON.

mod drawing;
mod model;

pub use drawing::{to_json, to_text};
pub use model::*;

use crate::draw;
use crate::ps::PsArgs;

pub fn run(args: &PsArgs) -> Result<(), String> {
    let root = crate::sysfs_root(args.sysfs_root.as_deref());
    let view = gather(&root);
    if args.json {
        let text = crate::json::pretty(&to_json(&view))?;
        println!("{text}");
    } else {
        let colour = draw::wants_colour(args.no_color);
        print!("{}", to_text(&view, colour, crate::grid::width()));
    }
    Ok(())
}
