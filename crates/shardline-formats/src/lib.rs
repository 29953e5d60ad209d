//! I/O shells around the pure layout core: reading untrusted safetensors releases, writing and
//! reading PyTorch Distributed Checkpoint (DCP) directories and DCP-sharded safetensors, executing
//! a plan with bounded memory, and verifying a written checkpoint against its source.
//!
//! Nothing here decides where a byte goes: that is the plan's job (`shardline-layout`).

pub mod checkpoint;
pub mod dcp_metadata;
pub mod execute;
pub mod pickle;
pub mod safetensors;
pub mod synth;
pub mod torch_save;
pub mod verify;
