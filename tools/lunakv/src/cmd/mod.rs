//! One module per command.

pub mod admin;
pub mod bench;
pub mod doctor;
pub mod drain;
pub mod events;
pub mod keys;
pub mod kv;
pub mod status;
pub mod up;
