//! `tllm-affinity`: the command line of SPEC §7; the subcommands live in `tllm_affinity_core::cli`.

fn main() -> std::process::ExitCode {
    tllm_affinity_core::cli::main()
}
