pub mod plan;
pub mod probe;
