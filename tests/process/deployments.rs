//! The four shared-process deployments of seeds/shared-process-affinity-never-restored.txt
//! (issue #5, item 4; docs/runtimes.md) on this machine's build: each deployment's program, its
//! table of rules and its own checks are in tests/common/deployments.rs, shared with the aarch64
//! tier.

use crate::common;

use common::deployments::*;
use common::tier::Native;
use common::*;

fn check(deployment: &Deployment) {
    common::deployments::check(&Native, deployment);
}

// One `#[test]` per deployment, named after the rule it shows.
table_tests! {
    check;
    /// Deployment 1, single-process TP1 worker in the HTTP server's process.
    tp1_worker_inside_the_http_server: TP1;
    /// Deployment 2, an externally supplied MpiCommSession, rank 0.
    mpi_comm_session_rank0_in_the_users_script: MPI_SESSION;
    /// Deployment 3, external-launch VisualGen rank 0 under an HTTP server.
    visualgen_rank0_coordinator_started_before_the_worker: VISUALGEN;
    /// Deployment 4, the leader of a multi-node launch.
    multi_node_leader_session_server_and_progress_threads: LEADER;
}
