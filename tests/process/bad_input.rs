//! Bad input, table-driven, on this machine's build: every library variable with malformed
//! values, in a compiled C program and in `sh` (the checks, shared with the aarch64 tier, are in
//! tests/common/bad_input.rs, which says what each asserts).

use crate::common;

use common::bad_input::*;
use common::tier::Native;

#[test]
fn malformed_load_time_variables_give_one_line_and_the_program_runs_on() {
    check_malformed_load_time_variables(&Native);
}

#[test]
fn malformed_configure_time_variables_give_one_line_and_an_errno() {
    check_malformed_configure_time_variables(&Native);
}

/// A TLLM_AFFINITY_GPU that is neither a CUDA device number nor a PCI address is a bad setting
/// at load, like any other (SPEC §9): one line, passive, status 2 under STRICT, even in a
/// program that never configures and so never needs it.
#[test]
fn a_malformed_gpu_is_refused_at_load_even_when_nothing_needs_it() {
    check_malformed_gpu_refused_at_load(&Native);
}

/// Every form SPEC §4 names still loads quietly under STRICT and picks its GPU at configure(-1).
#[test]
fn every_valid_gpu_form_is_accepted_at_load_and_used_by_configure() {
    check_every_valid_gpu_form(&Native);
}

/// A second configure whose worker set is empty changes nothing and says nothing new (SPEC §5):
/// the "no worker mask pinned" warning comes once per device; later ones are debug lines.
#[test]
fn a_repeated_empty_configure_warns_once() {
    check_repeated_empty_configure(&Native);
}
