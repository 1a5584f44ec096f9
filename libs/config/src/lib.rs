//! placeholder: module layout fixed so parallel work does not collide.
//! size.rs, client.rs (mooncake_config.json), store.rs: config owner; master.rs: master owner.
pub mod client;
pub mod master;
pub mod size;
pub mod store;
