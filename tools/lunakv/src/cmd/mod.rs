//! One module per command.

pub mod bench;
pub mod kv;
pub mod status;
pub mod up;
