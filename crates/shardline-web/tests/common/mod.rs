//! Test databases, shared with the other crates' tests through `shardline-testdb`: a fresh
//! SQLite file or a fresh PostgreSQL database per test (`SHARDLINE_TEST_DATABASE_URL`, which
//! `scripts/test` sets; PostgreSQL tests fail, never skip, without it).

pub use shardline_testdb::{Kind, TestDb};
