//! bigmodel: load and run models larger than any one device.
//!
//! This facade re-exports the layered crates under short names.

pub use bm_device as device;
pub use bm_dispatch as dispatch;
pub use bm_plan as plan;
pub use bm_shard as shard;
pub use bm_tensor as tensor;
