//! Test databases, shared with the other crates' tests through `shardline-testdb`.
#![allow(dead_code)]

#[allow(unused_imports)] // not every test binary uses both
pub use shardline_testdb::{Kind, TestDb};
