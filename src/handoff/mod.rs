//! What a process hands to the programs it starts: the launch variable that carries a launch's
//! identity and masks across `exec` ([`launch`]), and where the Python start-up hook comes from
//! ([`pyhook`]). Pure text and paths: uses only the root's leaves (masks).

pub mod launch;
pub mod pyhook;
