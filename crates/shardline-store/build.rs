//! `sqlx::migrate!` embeds the migration files when this crate compiles; without this, editing
//! or adding one would not rebuild the crate and a test could run the previous migrations.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
