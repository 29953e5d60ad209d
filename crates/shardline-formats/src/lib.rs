//! I/O shells around the pure layout core: reading untrusted safetensors releases, writing and
//! reading PyTorch Distributed Checkpoint (DCP) directories and DCP-sharded safetensors, executing
//! a plan with bounded memory, and verifying a written checkpoint against its source.
//!
//! Nothing here decides where a byte goes: that is the plan's job (`shardline-layout`).
//!
//! **Owns:** the file formats (safetensors, pickle, `torch.save` archives, DCP `.metadata`), the
//! copy of a plan into files and the strict reading of checkpoints back. **Must not depend on:**
//! any workspace crate but `shardline-layout`.

// Errors here carry what a person needs to find the problem (file, item, offset, what was
// expected) and are returned once per failed read, on a cold path: their size is not worth
// boxing every variant for.
#![allow(clippy::result_large_err)]

pub mod checkpoint;
pub mod dcp_metadata;
pub mod execute;
mod message;
pub mod out_dir;
pub mod pickle;
pub mod safetensors;
pub mod torch_save;
pub mod training;
pub mod verify;

pub use message::error_message;
