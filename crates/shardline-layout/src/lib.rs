//! The pure layout core of Shardline: dtypes, model architectures as mapping tables, the parallel
//! mesh, the conversion plan (every chunk of every output tensor, derived arithmetically), and the
//! invariants a plan must satisfy before a byte is written.
//!
//! **Architecture invariant:** this crate does no I/O, spawns nothing, and knows nothing of YAML,
//! HTTP, SQL or async runtimes; a test reads its manifest to keep it so.

pub mod dtype;

pub use dtype::DType;
